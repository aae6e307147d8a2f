from airlock import Client

with Client() as client:  # finds airlockd at $AIRLOCK_ADDR, else at its default socket
    with client.sandboxes.create(template="base") as sandbox:  # a microVM, destroyed on exit
        result = sandbox.exec_code("print(6*7)")  # Python, inside the microVM
        print(result.stdout, end="")  # 42
        print(f"exit code {result.exit_code}, {result.duration_ms} ms in the guest")
        for chunk in sandbox.start(["sh", "-c", "echo one; sleep 1; echo two"]).stream():
            print(chunk.stream, chunk.text, end="")  # output as it arrives
