#!/usr/bin/env python3
"""Airlock code-interpreter server (runs inside the code-interpreter guest).

Serves E2B's code-interpreter wire format (what `e2b_code_interpreter` 2.x parses) over
HTTP/1.1 on AF_VSOCK port 49999 and TCP 127.0.0.1:49999:

    GET    /health                -> 200 "OK"
    POST   /execute               -> 200 application/x-ndjson stream (chunked)
    POST   /contexts              -> 200 {"id","language","cwd"}
    GET    /contexts              -> 200 [{"id","language","cwd"}, ...]
    POST   /contexts/{id}/restart -> 200 null
    DELETE /contexts/{id}         -> 200 null

Languages: python (ipykernel through jupyter_client), bash (a persistent bash per context),
javascript and typescript (node_repl.js next to this file). Only the standard library and
jupyter_client are used. See README.md.
"""

import argparse
import codecs
import json
import logging
import os
import queue
import re
import select
import shlex
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("airlock-interpreter")

HERE = os.path.dirname(os.path.abspath(__file__))
LANGUAGES = ("python", "bash", "javascript", "typescript")
UNAVAILABLE = ("r", "java")
ALIASES = {"py": "python", "python3": "python", "js": "javascript", "ts": "typescript",
           "sh": "bash", "shell": "bash"}

# Jupyter MIME type -> E2B result field. Anything else goes into "extra".
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/chart": "chart",
    "e2b/data": "data",
}

ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# ipykernel settings: plain tracebacks and full reprs (as E2B's template), and inline figures
# at exactly figsize*dpi pixels (matplotlib_inline's default crops to a tight bounding box).
KERNEL_ARGS = [
    "--InteractiveShell.colors=NoColor",
    "--PlainTextFormatter.max_seq_length=0",
]
# Set in the kernel once it answers: as a command-line option, a dict is deprecated syntax in
# traitlets 5 (bookworm's), and the kernel would print a FutureWarning into a user's first
# figure cell.
KERNEL_SETUP = ("get_ipython().run_line_magic('config', "
                "\"InlineBackend.print_figure_kwargs = {'bbox_inches': None}\")")

# How long an interrupted cell may take to stop before its context is killed and restarted.
INTERRUPT_GRACE_S = 10.0
# How long a new kernel has to answer: about a second on a host; minutes on one emulated vCPU
# of a nested-KVM machine, where a cold ipykernel imports hundreds of modules (tens of minutes
# when that machine is busy).
KERNEL_READY_S = float(os.environ.get("AIRLOCK_INTERP_KERNEL_READY_S", "1800"))
VMSTAT = os.environ.get("AIRLOCK_INTERP_VMSTAT", "/proc/vmstat")
MAX_BODY = 64 << 20


class Config:
    default_cwd = "/home/user"
    sandbox_id_file = "/run/airlock/sandbox-id"
    node = None


CONFIG = Config()


class BadRequest(Exception):
    pass


class NotFound(Exception):
    pass


def strip_ansi(text):
    return ANSI_RE.sub("", text)


def read_oom_kills():
    """The guest's oom_kill counter from /proc/vmstat, or None."""
    try:
        with open(VMSTAT) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def read_sandbox_id():
    try:
        with open(CONFIG.sandbox_id_file, "rb") as f:
            return f.read()
    except OSError:
        return None


def death_error(oom_before, what):
    oom_after = read_oom_kills()
    if oom_before is not None and oom_after is not None and oom_after > oom_before:
        return {"type": "error", "name": "OomKilled",
                "value": f"The {what} was killed by the out-of-memory killer; "
                         "the context restarts on its next cell", "traceback": ""}
    return {"type": "error", "name": "KernelDied",
            "value": f"The {what} died during the execution; "
                     "the context restarts on its next cell", "traceback": ""}


def make_result(data, is_main):
    """A Jupyter MIME bundle -> E2B's result object."""
    out = {"type": "result"}
    extra = {}
    for mime, value in (data or {}).items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            out[field] = value
    text = out.get("text")
    # E2B's server strips one pair of surrounding quotes from text/plain ('abc' -> abc).
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    out["is_main_result"] = bool(is_main)
    return out


def _pdeathsig():
    # The child dies with the server (kill -9 included), so a restarted server never finds
    # orphans of its previous self.
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class _Spawner:
    """Runs Popen on one long-lived thread: PR_SET_PDEATHSIG fires when the forking *thread*
    exits, and the HTTP handler threads end with their connections."""

    def __init__(self):
        self.q = queue.Queue()
        threading.Thread(target=self._loop, name="spawner", daemon=True).start()

    def _loop(self):
        while True:
            fn, box, done = self.q.get()
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: B036 - handed back to the caller
                box["error"] = e
            done.set()

    def call(self, fn):
        box, done = {}, threading.Event()
        self.q.put((fn, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def popen(self, *args, **kwargs):
        return self.call(lambda: subprocess.Popen(*args, **kwargs))


SPAWNER = _Spawner()


def env_for_children():
    env = dict(os.environ)
    for k in [k for k in env if k.startswith("AIRLOCK_INTERP_")]:
        del env[k]
    return env


class Output:
    """The per-request sink: emit() writes one NDJSON line; gone() says the client left."""

    def __init__(self, emit, gone):
        self.emit = emit
        self.gone = gone


# --------------------------------------------------------------------------------------------
# Contexts


class Context:
    language = "?"

    def __init__(self, language, cwd):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()  # one cell (or restart) at a time
        self.dead = False
        self.restarting = False
        self.seed_mark = None

    def to_json(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    # Subclasses: start(), stop(), kill(), alive(), reseed(), run(code, env_vars, out)

    def ensure_started(self):
        if self.dead or not self.alive():
            log.info("context %s: (re)starting its %s process", self.id, self.language)
            self.stop()
            self.start()
            self.dead = False

    def maybe_reseed(self):
        mark = read_sandbox_id()
        if mark != self.seed_mark:
            log.info("context %s: sandbox id changed, reseeding", self.id)
            self.reseed()
            self.seed_mark = mark

    def execute(self, code, env_vars, out):
        with self.lock:
            self.restarting = False
            self.ensure_started()
            self.maybe_reseed()
            self.run(code, env_vars, out)

    def restart(self):
        self.restarting = True
        if not self.lock.acquire(timeout=0.5):
            self.kill()  # the running cell sees its process die and ends
            self.lock.acquire()
        try:
            self.stop()
            self.start()
            self.dead = False
        finally:
            self.restarting = False
            self.lock.release()

    def remove(self):
        self.restarting = True
        if not self.lock.acquire(timeout=0.5):
            self.kill()
            self.lock.acquire()
        try:
            self.stop()
        finally:
            self.lock.release()

    def _died(self, out, oom_before, what):
        self.dead = True
        if self.restarting:
            out.emit({"type": "error", "name": "ContextRestarting",
                      "value": "Context was restarted", "traceback": ""})
        else:
            out.emit(death_error(oom_before, what))


class _Watch:
    """Interrupts a context's running cell once its client is gone: again every second (an
    interrupt that lands before the cell starts is lost), then kills the process after
    INTERRUPT_GRACE_S; the context restarts on its next cell."""

    def __init__(self, ctx, out):
        self.ctx, self.out = ctx, out
        self.first = self.last = None

    def abandon(self):
        if not self.out.gone():
            return False
        now = time.monotonic()
        if self.first is None:
            log.info("context %s: client gone mid-cell, interrupting", self.ctx.id)
            self.first = now
        elif now - self.first > INTERRUPT_GRACE_S:
            log.warning("context %s: the interrupt did not stop the cell, killing", self.ctx.id)
            self.ctx.kill()
            self.ctx.dead = True
            return True
        if self.last is None or now - self.last >= 1.0:
            self.last = now
            try:
                self.ctx.interrupt()
            except Exception:
                log.exception("context %s: interrupting", self.ctx.id)
        return False


class PythonContext(Context):
    """An ipykernel driven through jupyter_client."""

    def __init__(self, cwd):
        super().__init__("python", cwd)
        self.km = None
        self.kc = None

    def start(self):
        from jupyter_client import KernelManager

        env = env_for_children()
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        if "MPLBACKEND" not in env:
            import importlib.util
            if importlib.util.find_spec("matplotlib_inline") is not None:
                env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
        km = KernelManager(kernel_name="python3")
        # The kernel dies with this server (ipykernel's own parent poller only notices a
        # re-parenting to pid 1, not to a subreaper such as the guest agent).
        SPAWNER.call(lambda: km.start_kernel(cwd=self.cwd, env=env, extra_arguments=KERNEL_ARGS,
                                             preexec_fn=_pdeathsig))
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=KERNEL_READY_S)
        except Exception:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
            raise
        self.km, self.kc = km, kc
        self._silent(KERNEL_SETUP)
        self.seed_mark = read_sandbox_id()

    def stop(self):
        if self.kc is not None:
            try:
                self.kc.stop_channels()
            except Exception:
                pass
        if self.km is not None:
            try:
                self.km.shutdown_kernel(now=True)
            except Exception:
                log.exception("shutting the kernel down")
        self.km = self.kc = None

    def kill(self):
        try:
            if self.km is not None:
                self.km.signal_kernel(signal.SIGKILL)
        except Exception:
            pass

    def alive(self):
        return self.km is not None and self.km.is_alive()

    def interrupt(self):
        self.km.interrupt_kernel()

    def _silent(self, code, timeout=30):
        """Runs code without output or history; returns the reply's content (or None)."""
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        return self._reply(msg_id, timeout)

    def _reply(self, msg_id, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_shell_msg(timeout=0.1)
            except queue.Empty:
                if not self.alive():
                    return None
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg["content"]
        return None

    def reseed(self):
        self._silent(
            "def _airlock_reseed():\n"
            "    import os, random, sys\n"
            "    random.seed(os.urandom(32))\n"
            "    if 'numpy' in sys.modules:\n"
            "        import numpy\n"
            "        numpy.random.seed([int.from_bytes(os.urandom(4), 'little') for _ in range(8)])\n"
            "_airlock_reseed()\n"
            "del _airlock_reseed\n")

    def run(self, code, env_vars, out):
        kc = self.kc
        if env_vars:
            self._silent(
                "_airlock_saved_env = {}\n"
                "def _airlock_setenv(d):\n"
                "    import os\n"
                "    for k, v in d.items():\n"
                "        _airlock_saved_env[k] = os.environ.get(k)\n"
                "        os.environ[k] = v\n"
                f"_airlock_setenv({env_vars!r})\n"
                "del _airlock_setenv\n")
        oom_before = read_oom_kills()
        msg_id = kc.execute(code, silent=False, store_history=True, allow_stdin=False,
                            stop_on_error=False)
        count = None
        errored = False
        watch = _Watch(self, out)
        while True:
            if watch.abandon():
                return
            try:
                msg = kc.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                if not self.alive():
                    self._died(out, oom_before, "kernel")
                    return
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                name = "stderr" if content.get("name") == "stderr" else "stdout"
                out.emit({"type": name, "text": content.get("text", ""),
                          "timestamp": _timestamp_ns(msg)})
            elif kind == "execute_result":
                out.emit(make_result(content.get("data"), True))
            elif kind == "display_data":
                out.emit(make_result(content.get("data"), False))
            elif kind == "error":
                if not errored:
                    errored = True
                    out.emit(_python_error(content))
            elif kind == "execute_input":
                count = content.get("execution_count", count)
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        reply = self._reply(msg_id, 5)
        if reply is not None:
            count = reply.get("execution_count", count)
            if reply.get("status") == "error" and not errored:
                out.emit(_python_error(reply))
            elif reply.get("status") == "aborted":
                out.emit({"type": "error", "name": "ExecutionAborted",
                          "value": "Execution was aborted", "traceback": ""})
        if env_vars:
            self._silent(
                "def _airlock_restoreenv():\n"
                "    import os\n"
                "    for k, v in _airlock_saved_env.items():\n"
                "        if v is None:\n"
                "            os.environ.pop(k, None)\n"
                "        else:\n"
                "            os.environ[k] = v\n"
                "_airlock_restoreenv()\n"
                "del _airlock_restoreenv, _airlock_saved_env\n")
        if count is not None:
            out.emit({"type": "number_of_executions", "execution_count": count})


def _timestamp_ns(msg):
    date = msg.get("header", {}).get("date")
    if hasattr(date, "timestamp"):
        return int(date.timestamp() * 1_000_000) * 1000
    return time.time_ns()


def _python_error(content):
    tb = content.get("traceback") or []
    return {"type": "error", "name": content.get("ename", ""), "value": content.get("evalue", ""),
            "traceback": strip_ansi("\n".join(tb))}


class _StreamSplitter:
    """Decodes a byte stream and cuts it at a sentinel, holding back a possible prefix of it."""

    def __init__(self, sentinel):
        self.sentinel = sentinel
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.buf = ""
        self.done = False
        self.tail = ""  # what followed the sentinel on its line

    def feed(self, data):
        """Returns the text that can be emitted now."""
        if self.done:
            return ""
        self.buf += self.decoder.decode(data)
        i = self.buf.find(self.sentinel)
        if i >= 0:
            text = self.buf[:i]
            rest = self.buf[i + len(self.sentinel):]
            if "\n" in rest:
                self.tail = rest.split("\n", 1)[0]
                self.done = True
                self.buf = ""
                return text
            self.buf = self.buf[i:]
            return text
        # Hold back the longest suffix that could start the sentinel.
        keep = 0
        for n in range(min(len(self.sentinel), len(self.buf)), 0, -1):
            if self.sentinel.startswith(self.buf[-n:]):
                keep = n
                break
        text = self.buf[:len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep:]
        return text


class _ProcessContext(Context):
    """Shared plumbing of bash and node contexts: a child with reader threads into a queue."""

    def __init__(self, language, cwd):
        super().__init__(language, cwd)
        self.proc = None
        self.q = None
        self.count = 0

    def _reader(self, fd, tag, q):
        try:
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                q.put((tag, data))
                if not data:
                    return
        finally:
            try:
                os.close(fd)
            except OSError:
                pass

    def _spawn(self, argv, extra_fds=(), env=None):
        self.q = queue.Queue()
        proc = SPAWNER.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=self.cwd, env=env or env_for_children(),
                                start_new_session=True, pass_fds=extra_fds,
                                preexec_fn=_pdeathsig)
        for tag, f in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            fd = os.dup(f.fileno())
            f.close()
            threading.Thread(target=self._reader, args=(fd, tag, self.q), daemon=True).start()
        self.proc = proc
        self.seed_mark = read_sandbox_id()
        self.count = 0

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass

    def stop(self):
        if self.proc is not None:
            self.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self.proc = None

    def interrupt(self):
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except OSError:
            pass

    def _send(self, text):
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()


class BashContext(_ProcessContext):
    """A persistent bash; each cell is sourced from a file and ends with a sentinel line on
    stdout (with the cell's exit status) and on stderr. A non-zero status is an error named
    CommandExitError; `exit` ends the shell (KernelDied, a fresh shell on the next cell)."""

    def __init__(self, cwd):
        super().__init__("bash", cwd)
        self.tmpdir = None

    def start(self):
        if self.tmpdir is None:
            self.tmpdir = tempfile.mkdtemp(prefix="airlock-bash-")
        self._spawn(["bash", "--noprofile", "--norc"])
        # SIGINT (an interrupt) ends the sourced cell, not the shell.
        self._send("trap 'return 130 2>/dev/null' INT\n")

    def stop(self):
        super().stop()

    def remove(self):
        super().remove()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def reseed(self):
        self._send('RANDOM=$(( $(od -An -N4 -tu4 /dev/urandom) ))\n')

    def run(self, code, env_vars, out):
        token = "__AIRLOCK_END_" + uuid.uuid4().hex + "__"
        path = os.path.join(self.tmpdir, "cell.sh")
        with open(path, "w") as f:
            f.write(code)
            if not code.endswith("\n"):
                f.write("\n")
        pre, post = [], []
        for k, v in (env_vars or {}).items():
            if not ENV_NAME_RE.match(k):
                continue
            pre.append(f'if [ -n "${{{k}+x}}" ]; then __airlock_old_{k}=${k}; __airlock_had_{k}=1; '
                       f'else __airlock_had_{k}=0; fi; export {k}={shlex.quote(v)}')
            post.append(f'if [ "$__airlock_had_{k}" = 1 ]; then {k}=$__airlock_old_{k}; '
                        f'else unset {k}; fi; unset __airlock_old_{k} __airlock_had_{k}')
        script = "\n".join(pre + [f"source {shlex.quote(path)} </dev/null",
                                  "__airlock_rc=$?"] + post +
                           [f"printf '%s%d\\n' {token} \"$__airlock_rc\"",
                            f"printf '%s\\n' {token} >&2", ""])
        self.count += 1
        oom_before = read_oom_kills()
        try:
            self._send(script)
        except OSError:
            self._died(out, oom_before, "bash process")
            return
        splitters = {"stdout": _StreamSplitter(token), "stderr": _StreamSplitter(token)}
        watch = _Watch(self, out)
        eof = set()
        while not all(s.done for s in splitters.values()):
            if watch.abandon():
                return
            try:
                tag, data = self.q.get(timeout=0.1)
            except queue.Empty:
                if not self.alive() and not self.q.qsize():
                    self._died(out, oom_before, "bash process")
                    return
                continue
            if not data:
                eof.add(tag)
                if len(eof) == 2:
                    try:
                        self.proc.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        pass
                    self._died(out, oom_before, "bash process")
                    return
                continue
            text = splitters[tag].feed(data)
            if text:
                out.emit({"type": tag, "text": text, "timestamp": time.time_ns()})
        try:
            rc = int(splitters["stdout"].tail.strip() or 0)
        except ValueError:
            rc = 0
        if rc != 0:
            out.emit({"type": "error", "name": "CommandExitError",
                      "value": f"exit status {rc}", "traceback": ""})
        out.emit({"type": "number_of_executions", "execution_count": self.count})


class NodeContext(_ProcessContext):
    """node_repl.js: cells as JSON lines on its stdin, messages back as JSON lines on an extra
    pipe; what its children write to fd 1/2 directly is forwarded as stdout/stderr."""

    def __init__(self, language, cwd):
        super().__init__(language, cwd)

    def start(self):
        node = CONFIG.node or shutil.which("node") or "/usr/local/bin/node"
        r, w = os.pipe()
        env = env_for_children()
        env["AIRLOCK_REPL_FD"] = str(w)
        try:
            self._spawn([node, "--expose-internals", "--no-warnings",
                         os.path.join(HERE, "node_repl.js")], extra_fds=(w,), env=env)
        finally:
            os.close(w)
        threading.Thread(target=self._reader, args=(r, "msg", self.q), daemon=True).start()
        self.msgbuf = b""

    def reseed(self):
        self._send(json.dumps({"reseed": True}) + "\n")

    def run(self, code, env_vars, out):
        cell = uuid.uuid4().hex
        oom_before = read_oom_kills()
        try:
            self._send(json.dumps({"id": cell, "code": code, "env": env_vars or {},
                                   "typescript": self.language == "typescript"}) + "\n")
        except OSError:
            self._died(out, oom_before, "node process")
            return
        watch = _Watch(self, out)
        while True:
            if watch.abandon():
                return
            try:
                tag, data = self.q.get(timeout=0.1)
            except queue.Empty:
                if not self.alive() and not self.q.qsize():
                    self._died(out, oom_before, "node process")
                    return
                continue
            if tag != "msg":
                if data:
                    out.emit({"type": tag, "text": data.decode("utf-8", "replace"),
                              "timestamp": time.time_ns()})
                continue
            if not data:
                try:
                    self.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
                self._died(out, oom_before, "node process")
                return
            self.msgbuf += data
            while b"\n" in self.msgbuf:
                line, self.msgbuf = self.msgbuf.split(b"\n", 1)
                try:
                    m = json.loads(line)
                except ValueError:
                    continue
                if m.get("id") != cell:
                    continue
                t = m.get("type")
                if t in ("stdout", "stderr"):
                    out.emit({"type": t, "text": m.get("text", ""), "timestamp": time.time_ns()})
                elif t == "result":
                    out.emit(make_result(m.get("data"), m.get("is_main_result", True)))
                elif t == "error":
                    out.emit({"type": "error", "name": m.get("name", "Error"),
                              "value": m.get("value", ""), "traceback": m.get("traceback", "")})
                elif t == "done":
                    out.emit({"type": "number_of_executions",
                              "execution_count": m.get("execution_count", 0)})
                    return


class Registry:
    def __init__(self):
        self.lock = threading.Lock()
        self.contexts = {}
        self.defaults = {}
        self.default_locks = {lang: threading.Lock() for lang in LANGUAGES}

    @staticmethod
    def normalize(language):
        if language is None or language == "":
            return "python"
        if not isinstance(language, str):
            raise BadRequest("language must be a string")
        lang = language.strip().lower()
        lang = ALIASES.get(lang, lang)
        if lang in UNAVAILABLE:
            raise BadRequest("language not available in this template")
        if lang not in LANGUAGES:
            raise BadRequest(f"unknown language: {language}")
        return lang

    def create(self, language, cwd=None):
        lang = self.normalize(language)
        cwd = cwd or CONFIG.default_cwd
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise BadRequest(f"cwd is not a directory: {cwd}")
        if lang == "python":
            ctx = PythonContext(cwd)
        elif lang == "bash":
            ctx = BashContext(cwd)
        else:
            ctx = NodeContext(lang, cwd)
        ctx.start()
        with self.lock:
            self.contexts[ctx.id] = ctx
        log.info("context %s created (%s, cwd %s)", ctx.id, lang, cwd)
        return ctx

    def get(self, ctx_id):
        with self.lock:
            ctx = self.contexts.get(ctx_id)
        if ctx is None:
            raise NotFound(f"Context {ctx_id} not found")
        return ctx

    def default(self, language):
        lang = self.normalize(language)
        with self.default_locks[lang]:
            with self.lock:
                ctx = self.contexts.get(self.defaults.get(lang))
            if ctx is None:
                ctx = self.create(lang)
                self.defaults[lang] = ctx.id
            return ctx

    def list(self):
        with self.lock:
            return [c.to_json() for c in self.contexts.values()]

    def remove(self, ctx_id):
        ctx = self.get(ctx_id)
        with self.lock:
            self.contexts.pop(ctx_id, None)
            for lang, cid in list(self.defaults.items()):
                if cid == ctx_id:
                    del self.defaults[lang]
        ctx.remove()

    def shutdown(self):
        with self.lock:
            ctxs = list(self.contexts.values())
            self.contexts.clear()
        for c in ctxs:
            try:
                c.stop()
            except Exception:
                pass


REGISTRY = Registry()


# --------------------------------------------------------------------------------------------
# HTTP


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "airlock-interpreter/1"

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.client_address, fmt % args)

    def _reply(self, status, body=b"", ctype="text/plain; charset=utf-8"):
        if isinstance(body, str):
            body = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status, obj):
        self._reply(status, json.dumps(obj), "application/json")

    def _body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    break
                data += self.rfile.read(size)
                self.rfile.readline()
                if len(data) > MAX_BODY:
                    raise BadRequest("body too large")
            return data
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise BadRequest("body too large")
        return self.rfile.read(n) if n else b""

    def _json_body(self):
        raw = self._body()
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"invalid JSON: {e}")
        if not isinstance(obj, dict):
            raise BadRequest("the body must be a JSON object")
        return obj

    def _route(self, method):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if method == "GET" and path == "/health":
                return self._reply(200, "OK")
            if method == "GET" and path == "/contexts":
                return self._json(200, REGISTRY.list())
            if method == "POST" and path == "/contexts":
                body = self._json_body()
                ctx = REGISTRY.create(body.get("language"), body.get("cwd"))
                return self._json(200, ctx.to_json())
            if method == "POST" and path == "/execute":
                return self._execute(self._json_body())
            m = re.fullmatch(r"/contexts/([^/]+)/restart", path)
            if method == "POST" and m:
                self._body()
                REGISTRY.get(m.group(1)).restart()
                return self._json(200, None)
            m = re.fullmatch(r"/contexts/([^/]+)", path)
            if method == "DELETE" and m:
                REGISTRY.remove(m.group(1))
                return self._json(200, None)
            return self._reply(404, "not found")
        except BadRequest as e:
            return self._reply(400, str(e))
        except NotFound as e:
            return self._reply(404, str(e))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:
            log.exception("%s %s", method, path)
            try:
                return self._reply(500, f"{type(e).__name__}: {e}")
            except OSError:
                self.close_connection = True

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_DELETE(self):
        self._route("DELETE")

    def _execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        env_vars = body.get("env_vars") or {}
        if not isinstance(env_vars, dict):
            raise BadRequest("env_vars must be an object")
        env_vars = {str(k): "" if v is None else str(v) for k, v in env_vars.items()}
        ctx_id, language = body.get("context_id"), body.get("language")
        if ctx_id:
            ctx = REGISTRY.get(ctx_id)
            if language and Registry.normalize(language) != ctx.language:
                raise BadRequest("language does not match the context's language")
        else:
            ctx = REGISTRY.default(language)

        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.flush()
        state = {"gone": False}
        sock = self.connection

        def gone():
            if state["gone"]:
                return True
            try:
                r, _, _ = select.select([sock], [], [], 0)
                if r and sock.recv(1, socket.MSG_PEEK) == b"":
                    state["gone"] = True
            except OSError:
                state["gone"] = True
            return state["gone"]

        def emit(obj):
            if state["gone"]:
                return
            line = (json.dumps(obj, ensure_ascii=False) + "\n").encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            except OSError:
                state["gone"] = True

        out = Output(emit, gone)
        try:
            ctx.execute(code, env_vars, out)
        except Exception as e:
            log.exception("context %s: execution failed", ctx.id)
            ctx.dead = True
            emit({"type": "error", "name": "InterpreterError", "value": f"{type(e).__name__}: {e}",
                  "traceback": ""})
        emit({"type": "end_of_execution"})
        if state["gone"]:
            self.close_connection = True
            return
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True


class TCPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class VsockServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False
    address_family = getattr(socket, "AF_VSOCK", -1)

    def server_bind(self):
        socketserver.TCPServer.server_bind(self)
        self.server_name = "vsock"
        self.server_port = self.server_address[1]


def parse_hostport(s):
    host, _, port = s.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def main(argv=None):
    env = os.environ.get
    p = argparse.ArgumentParser(description="Airlock code-interpreter server")
    p.add_argument("--tcp", action="append",
                   help="HOST:PORT to listen on (repeatable; default 127.0.0.1:49999, "
                        "env AIRLOCK_INTERP_TCP, comma-separated)")
    p.add_argument("--vsock-port", type=int, default=int(env("AIRLOCK_INTERP_VSOCK_PORT", "49999")))
    p.add_argument("--no-vsock", action="store_true", default=env("AIRLOCK_INTERP_NO_VSOCK") == "1")
    p.add_argument("--default-cwd", default=env("AIRLOCK_INTERP_CWD", "/home/user"))
    p.add_argument("--sandbox-id-file",
                   default=env("AIRLOCK_SANDBOX_ID_FILE", "/run/airlock/sandbox-id"))
    p.add_argument("--node", default=env("AIRLOCK_INTERP_NODE"))
    p.add_argument("--no-warm", action="store_true",
                   help="do not start the default python context before listening")
    p.add_argument("--log-level", default=env("AIRLOCK_INTERP_LOG", "INFO"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s airlock-interpreter %(levelname)s %(message)s")
    CONFIG.default_cwd = a.default_cwd
    if not os.path.isdir(CONFIG.default_cwd):
        CONFIG.default_cwd = os.path.expanduser("~")
        log.warning("default cwd %s is missing, using %s", a.default_cwd, CONFIG.default_cwd)
    CONFIG.sandbox_id_file = a.sandbox_id_file
    CONFIG.node = a.node

    def on_term(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)

    if not a.no_warm:
        try:
            REGISTRY.default("python")
        except Exception:
            log.exception("starting the default python context (retried on first use)")

    servers = []
    tcp = a.tcp or [s for s in env("AIRLOCK_INTERP_TCP", "127.0.0.1:49999").split(",") if s]
    for spec in tcp:
        host, port = parse_hostport(spec)
        srv = TCPServer((host, port), Handler)
        servers.append(srv)
        print(f"listening tcp {srv.server_address[0]}:{srv.server_address[1]}", flush=True)
    if not a.no_vsock:
        if not hasattr(socket, "AF_VSOCK"):
            log.info("AF_VSOCK is not available, not listening on vsock")
        else:
            try:
                srv = VsockServer((socket.VMADDR_CID_ANY, a.vsock_port), Handler)
                servers.append(srv)
                print(f"listening vsock {a.vsock_port}", flush=True)
            except OSError as e:
                log.info("vsock listener unavailable (%s), not listening on vsock", e)
    if not servers:
        log.error("nothing to listen on")
        return 1
    for srv in servers[1:]:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        servers[0].serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        REGISTRY.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
