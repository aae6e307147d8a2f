"""Starts rootfs/interpreter/server.py on a free TCP port (no vsock) for the tests."""

import http.client
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(os.path.dirname(HERE), "server.py")


class Server:
    def __init__(self, port, workdir, sandbox_id_file, node):
        self.port = port
        self.node = node
        self.workdir = workdir
        self.sandbox_id_file = sandbox_id_file

    def conn(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method, path, body=None, timeout=60):
        c = self.conn(timeout)
        try:
            data = None if body is None else (body if isinstance(body, (bytes, str)) else json.dumps(body))
            c.request(method, path, body=data, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, r.read().decode()
        finally:
            c.close()

    def execute_lines(self, body, timeout=60):
        """POST /execute; returns (status, [NDJSON lines]) or (status, text) on errors."""
        c = self.conn(timeout)
        try:
            c.request("POST", "/execute", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                return r.status, r.read().decode()
            assert r.getheader("Content-Type") == "application/x-ndjson"
            lines = []
            while True:
                line = r.readline()
                if not line:
                    break
                if line.strip():
                    lines.append(line.decode())
            return r.status, lines
        finally:
            c.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("interp")
    sid = work / "sandbox-id"
    sid.write_text("sandbox-1")
    env = dict(os.environ)
    env["AIRLOCK_SANDBOX_ID_FILE"] = str(sid)
    # A stand-in for /proc/vmstat, so a cell can play the OOM killer.
    (work / "vmstat").write_text("nr_free_pages 1\noom_kill 0\n")
    env["AIRLOCK_INTERP_VMSTAT"] = str(work / "vmstat")
    node = os.environ.get("AIRLOCK_INTERP_NODE") or shutil.which("node")
    args = [sys.executable, SERVER, "--tcp", "127.0.0.1:0", "--no-vsock",
            "--default-cwd", str(work)]
    if node:
        args += ["--node", node]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening tcp "), line
        port = int(line.rsplit(":", 1)[1])
        srv = Server(port, str(work), str(sid), node)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if srv.request("GET", "/health", timeout=5) == (200, "OK"):
                    break
            except OSError:
                time.sleep(0.1)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
