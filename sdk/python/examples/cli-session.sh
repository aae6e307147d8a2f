airlock template ls                                 # "base" (made by `airlock template create base`)
ID=$(airlock create --label demo=cli)               # restores a microVM; prints its id
airlock exec "$ID" -- python3 -c 'print(6*7)'       # 42, and airlock exits with the remote code
echo 'print("hello from a file")' > hello.py
airlock cp hello.py "$ID":/tmp/hello.py             # files in and out (the policy allows /tmp)
airlock exec "$ID" -- python3 /tmp/hello.py
airlock exec "$ID" -- sh -c 'echo "6*7=$((6*7))" > /tmp/result.txt'
airlock cp "$ID":/tmp/result.txt result.txt
airlock exec "$ID" --timeout 2 -- sleep 60 || echo "exit $?"   # exit 124: the daemon ended it
airlock --json ls                                   # JSON for scripts
airlock rm "$ID"                                    # destroy (idempotent)
