#!/usr/bin/python3
"""Warm-up of the code-interpreter template, run in the guest before its snapshot:

    airlock template create code-interpreter --from code-interpreter \
        --warmup /usr/lib/airlock/interpreter-warmup

Waits until the interpreter server (started by the guest agent from
/etc/airlock/services/interpreter.json) answers GET /health on 127.0.0.1:49999, then runs a
cell in the default Python context, so that the snapshot holds a started kernel with numpy,
pandas and matplotlib (pyplot, whose first import builds the font cache) imported: the first
cell of every sandbox made from the template pays none of that. Exits 0 once the cell gave
the result 2; 1 (with the reason on stderr) otherwise.
"""

import json
import sys
import time
import urllib.error
import urllib.request

BASE = "http://127.0.0.1:49999"
# The server answers /health once its first Python kernel is up: seconds on a host, up to tens
# of minutes on one emulated vCPU of a nested-KVM machine shared with other work (a cold Python
# imports jupyter_client, ipykernel, IPython). The daemon's template build limit
# (template_build_timeout_s) is the one that counts; these only end a warm-up that would
# otherwise wait forever.
HEALTH_WAIT_S = 3000
CELL_TIMEOUT_S = 1200
CODE = "import numpy, pandas, matplotlib\nimport matplotlib.pyplot\n1+1"


def fail(message):
    print(f"interpreter-warmup: {message}", file=sys.stderr)
    sys.exit(1)


def wait_healthy():
    deadline = time.monotonic() + HEALTH_WAIT_S
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(BASE + "/health", timeout=5) as r:
                if r.status == 200:
                    return
                last = f"status {r.status}"
        except (OSError, urllib.error.URLError) as e:
            last = str(e)
        time.sleep(0.2)
    fail(f"{BASE}/health did not answer 200 within {HEALTH_WAIT_S} s ({last})")


def run_cell():
    body = json.dumps({"code": CODE, "language": "python"}).encode()
    req = urllib.request.Request(
        BASE + "/execute",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    results, ended = [], False
    try:
        with urllib.request.urlopen(req, timeout=CELL_TIMEOUT_S) as r:
            for line in r:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("type")
                if kind == "error":
                    fail(f"the cell failed: {event.get('name')}: {event.get('value')}\n"
                         f"{event.get('traceback', '')}")
                if kind == "result":
                    results.append(event.get("text"))
                if kind == "end_of_execution":
                    ended = True
    except urllib.error.HTTPError as e:
        fail(f"POST /execute: {e}: {e.read(4096).decode('utf-8', 'replace')}")
    except (OSError, urllib.error.URLError, ValueError) as e:
        fail(f"POST /execute: {e}")
    if not ended:
        fail("the cell's stream ended without end_of_execution")
    if "2" not in results:
        fail(f"expected the result 2, got {results!r}")


def main():
    started = time.monotonic()
    wait_healthy()
    healthy = time.monotonic()
    run_cell()
    done = time.monotonic()
    print(f"interpreter-warmup: healthy after {healthy - started:.1f} s, "
          f"warm cell {done - healthy:.1f} s")


if __name__ == "__main__":
    main()
