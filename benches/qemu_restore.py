#!/usr/bin/env python3
"""Reference benchmark: QEMU restoring its own snapshot of the Airlock guest.

For comparison with airlock-vmm's snapshot restore: the same kernel and base image on QEMU's
`microvm` machine, with the exact command line of kernel-config/qemu-boot.sh (captured by
running that script with a stand-in `qemu-system-x86_64` first in PATH, so the two cannot
drift apart; AIRLOCK_QEMU_CPU / AIRLOCK_QEMU_APPEND apply as they do there).

Steps:
  1. Boot once (a boot takes ~45-50 s on the nested-KVM build hosts, where the guest kernel is
     emulated) with a QMP socket added; as soon as the serial console shows
     `airlock: userspace up`, `stop` the VM over QMP, migrate it to a file (`file:` URI where
     QEMU has it, 8.2+, else `exec:cat > FILE`), `quit`.
  2. Each run starts a fresh QEMU with the same command line plus `-incoming defer` and
     measures
       qemu_restore_ms             from sending `migrate-incoming` to the VM running;
       qemu_process_to_running_ms  from just before the QEMU process is spawned to running.
     The source was stopped before the migration, so QEMU restores it paused (it keeps the
     source's run state and ignores autostart); the timed interval therefore ends with a
     `cont`: migrate-incoming -> MIGRATION event `completed` -> cont -> RESUME event.
     The snapshot file was just written, so it is read from the page cache.
  3. After each timed run (untimed) it checks that the restored guest actually executes:
     without a vsock device the agent powers the VM off right after the ready line, so a
     restored guest requests a reset shortly after it resumes (SHUTDOWN event), and may print
     more console lines; `guest_ran_after_restore` records what was seen.

Both QEMUs also get `-no-shutdown`: with qemu-boot.sh's `-no-reboot`, a guest reset then pauses
QEMU instead of ending it, so a reset that wins the race against `stop` is detected (and
reported) rather than ending the process mid-protocol. It changes no device.

Usage: AIRLOCK_KERNEL=... AIRLOCK_ROOTFS=... benches/qemu_restore.py [--runs 5]
       [--mem-mib 256] [--vcpus 1] [--workdir DIR]
Progress goes to stderr; the last line of stdout is one JSON object. Exit 1 on any failure.
"""
import argparse
import json
import os
import platform
import re
import select
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

from stats import summary  # benches/stats.py

READY = b"airlock: userspace up"
HERE = os.path.dirname(os.path.abspath(__file__))
QEMU_BOOT = os.path.join(HERE, "..", "kernel-config", "qemu-boot.sh")
QEMU = "qemu-system-x86_64"


class BenchError(Exception):
    pass


def log(msg):
    print(f"qemu_restore: {msg}", file=sys.stderr, flush=True)


# --- QMP -------------------------------------------------------------------------------------

class Qmp:
    """A minimal QMP client: one command at a time, events kept in arrival order."""

    def __init__(self, path, proc, deadline):
        self.proc = proc
        self.buf = b""
        self.events = []
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if proc.poll() is not None:
                    raise BenchError(f"QEMU exited (status {proc.returncode}) before its QMP "
                                     f"socket accepted a connection")
                if time.monotonic() > deadline:
                    raise BenchError(f"QMP socket {path} did not accept a connection in time")
                time.sleep(0.001)
        self.sock = s
        greeting = self._read_msg(deadline)
        if "QMP" not in greeting:
            raise BenchError(f"unexpected QMP greeting: {greeting}")
        self.cmd("qmp_capabilities", timeout=10)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def _read_msg(self, deadline):
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("QMP: no message before the deadline")
            r, _, _ = select.select([self.sock], [], [], left)
            if not r:
                continue
            chunk = self.sock.recv(65536)
            if not chunk:
                raise BenchError("QMP connection closed by QEMU" + self._exit_note())
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def _exit_note(self):
        try:
            code = self.proc.wait(timeout=2)
            return f" (QEMU exited with status {code})"
        except subprocess.TimeoutExpired:
            return ""

    def send(self, name, args=None):
        msg = {"execute": name}
        if args is not None:
            msg["arguments"] = args
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def recv_return(self, name, deadline):
        while True:
            msg = self._read_msg(deadline)
            if "event" in msg:
                self.events.append(msg)
                continue
            if "error" in msg:
                raise BenchError(f"QMP {name}: {msg['error'].get('class')}: "
                                 f"{msg['error'].get('desc')}")
            if "return" in msg:
                return msg["return"]

    def cmd(self, name, args=None, timeout=30):
        self.send(name, args)
        return self.recv_return(name, time.monotonic() + timeout)

    def wait_event(self, pred, deadline):
        """Returns the first queued or arriving event for which pred(event) is true."""
        while True:
            for i, ev in enumerate(self.events):
                if pred(ev):
                    return self.events.pop(i)
            msg = self._read_msg(deadline)
            if "event" in msg:
                self.events.append(msg)


# --- processes -------------------------------------------------------------------------------

def spawn(argv, stdout, stderr):
    # Own session, so that kill_tree() also reaches QEMU's `exec:` helpers (sh, cat).
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            start_new_session=True)


def kill_tree(proc):
    """Kills a QEMU this script started (by its pid, then its own process group)."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log(f"QEMU pid {proc.pid} did not die after SIGKILL")
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # leftovers in the group it led (exec: helpers)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path, n=2000):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# --- the QEMU command line -------------------------------------------------------------------

def qemu_argv(qemu_boot, kernel, rootfs, vcpus, mem_mib, workdir):
    """The argv kernel-config/qemu-boot.sh would exec, captured with a stand-in binary."""
    shim_dir = os.path.join(workdir, "argv-shim")
    os.makedirs(shim_dir, exist_ok=True)
    out = os.path.join(workdir, "qemu-argv.bin")
    shim = os.path.join(shim_dir, QEMU)
    with open(shim, "w") as f:
        f.write('#!/bin/sh\nprintf "%s\\0" "$0" "$@" > "$AIRLOCK_ARGV_OUT"\n')
    os.chmod(shim, stat.S_IRWXU)
    env = dict(os.environ, PATH=shim_dir + os.pathsep + os.environ.get("PATH", ""),
               AIRLOCK_QEMU_MEM=str(mem_mib), AIRLOCK_ARGV_OUT=out)
    r = subprocess.run(["bash", qemu_boot, kernel, rootfs, str(vcpus)], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if r.returncode != 0 or not os.path.exists(out):
        raise BenchError(f"{qemu_boot} failed (exit {r.returncode}): "
                         f"{r.stderr.decode(errors='replace').strip()}")
    with open(out, "rb") as f:
        argv = f.read().split(b"\0")[:-1]
    argv = [a.decode() for a in argv]
    if not argv or os.path.basename(argv[0]) != QEMU:
        raise BenchError(f"could not capture the QEMU command line of {qemu_boot}")
    real = shutil.which(QEMU)
    if real is None:
        raise BenchError(f"{QEMU} is missing: apt-get install -y qemu-system-x86")
    argv[0] = real
    joined = " ".join(argv)
    if "-serial stdio" not in joined or "microvm" not in joined:
        raise BenchError(f"unexpected qemu-boot.sh command line (wanted microvm and "
                         f"-serial stdio): {joined}")
    return argv


def qemu_version(binary):
    out = subprocess.run([binary, "--version"], stdout=subprocess.PIPE, text=True).stdout
    first = out.splitlines()[0] if out else ""
    return re.sub(r"^QEMU emulator version\s*", "", first).strip()


def supports_file_uri(version):
    m = re.match(r"(\d+)\.(\d+)", version)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (8, 2)


# --- step 1: boot once and save --------------------------------------------------------------

def boot_and_save(argv, workdir, snapshot, boot_timeout, use_file_uri):
    qmp_path = os.path.join(workdir, "source.qmp")
    serial_path = os.path.join(workdir, "source-serial.log")
    stderr_path = os.path.join(workdir, "source-stderr.log")
    for p in (qmp_path, snapshot):
        if os.path.exists(p):
            os.unlink(p)
    cmd = argv + ["-no-shutdown", "-qmp", f"unix:{qmp_path},server=on,wait=off"]
    log("booting the source VM once: " + " ".join(shlex.quote(a) for a in cmd))
    proc = qmp = drain = None
    serial = open(serial_path, "wb")
    errf = open(stderr_path, "wb")
    try:
        start = time.monotonic()
        deadline = start + boot_timeout
        proc = spawn(cmd, subprocess.PIPE, errf)
        qmp = Qmp(qmp_path, proc, time.monotonic() + 30)
        fd = proc.stdout.fileno()
        seen = b""
        ready_ms = None
        while ready_ms is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"no '{READY.decode()}' on the console within {boot_timeout:.0f} s "
                                 f"(console tail: {seen[-500:].decode(errors='replace')!r})")
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise BenchError(f"QEMU closed its console before '{READY.decode()}' "
                                 f"(exit {proc.wait()}): {tail(stderr_path)}")
            serial.write(chunk)
            seen = (seen + chunk)[-4096:]
            if READY in seen:
                # The agent powers the VM off right after this line (no vsock device): stop it
                # first. The QMP session is already open, so this is one round trip.
                qmp.send("stop")
                ready_ms = (time.monotonic() - start) * 1000.0
        qmp.recv_return("stop", time.monotonic() + 30)

        def pump():
            while True:
                try:
                    c = os.read(fd, 65536)
                except OSError:
                    return
                if not c:
                    return
                serial.write(c)
        drain = threading.Thread(target=pump, daemon=True)
        drain.start()

        status = qmp.cmd("query-status")
        resets = [e for e in qmp.events if e.get("event") in ("SHUTDOWN", "RESET")]
        log(f"source: userspace up after {ready_ms:.0f} ms; stopped, status {status.get('status')}")
        if status.get("status") != "paused" or resets:
            raise BenchError(f"the guest reset before `stop` took effect (status "
                             f"{status.get('status')}, events {resets}): the agent powers off "
                             f"right after the ready line and won the race; rerun")

        qmp.cmd("migrate-set-parameters", {"max-bandwidth": 64 << 30})  # no save throttling
        if use_file_uri:
            uri = f"file:{snapshot}"
        else:
            uri = "exec:cat > " + shlex.quote(snapshot)
        log(f"saving the snapshot: migrate {uri}")
        t0 = time.monotonic()
        qmp.cmd("migrate", {"uri": uri})
        mig_deadline = t0 + 600
        while True:
            info = qmp.cmd("query-migrate")
            st = info.get("status")
            if st == "completed":
                break
            if st in ("failed", "cancelled"):
                raise BenchError(f"migrate to {uri} {st}: {info.get('error-desc', info)}")
            if time.monotonic() > mig_deadline:
                raise BenchError(f"migrate to {uri} did not complete in 600 s: {info}")
            time.sleep(0.05)
        save_ms = (time.monotonic() - t0) * 1000.0
        qmp.send("quit")
        try:
            qmp.recv_return("quit", time.monotonic() + 10)
        except (BenchError, TimeoutError):
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            log("source QEMU did not quit; killing it")
        if not os.path.exists(snapshot):
            raise BenchError(f"migration reported completed but {snapshot} does not exist")
        size = os.path.getsize(snapshot)
        log(f"snapshot saved in {save_ms:.0f} ms: {size} bytes ({size / 2**20:.1f} MiB)")
        return {"boot_to_ready_ms": round(ready_ms, 1), "save_ms": round(save_ms, 1),
                "snapshot_bytes": size, "uri": uri}
    finally:
        if qmp:
            qmp.close()
        kill_tree(proc)
        if drain:
            drain.join(timeout=5)
        serial.close()
        errf.close()


# --- step 2: restore, timed ------------------------------------------------------------------

def restore_once(argv, workdir, snapshot, use_file_uri, run, timeout, verify_timeout):
    qmp_path = os.path.join(workdir, f"restore-{run}.qmp")
    serial_path = os.path.join(workdir, f"restore-{run}-serial.log")
    stderr_path = os.path.join(workdir, f"restore-{run}-stderr.log")
    if os.path.exists(qmp_path):
        os.unlink(qmp_path)
    uri = f"file:{snapshot}" if use_file_uri else "exec:cat " + shlex.quote(snapshot)
    cmd = argv + ["-no-shutdown", "-qmp", f"unix:{qmp_path},server=on,wait=off",
                  "-incoming", "defer"]
    proc = qmp = None
    serial = open(serial_path, "wb")
    errf = open(stderr_path, "wb")
    try:
        t_exec = time.monotonic()
        proc = spawn(cmd, serial, errf)
        deadline = t_exec + timeout
        qmp = Qmp(qmp_path, proc, deadline)
        qmp.cmd("migrate-set-capabilities",
                {"capabilities": [{"capability": "events", "state": True}]})
        st = qmp.cmd("query-status").get("status")
        if st != "inmigrate":
            raise BenchError(f"fresh QEMU with -incoming defer is in state {st!r}, not inmigrate")

        t_in = time.monotonic()
        qmp.cmd("migrate-incoming", {"uri": uri})
        ev = qmp.wait_event(lambda e: e.get("event") == "MIGRATION" and e["data"]["status"]
                            in ("completed", "failed", "cancelled"), deadline)
        if ev["data"]["status"] != "completed":
            raise BenchError(f"incoming migration {ev['data']['status']}")
        t_loaded = time.monotonic()
        # The source was paused, so QEMU keeps the restored VM paused; resume it.
        qmp.cmd("cont")
        qmp.wait_event(lambda e: e.get("event") == "RESUME", deadline)
        t_run = time.monotonic()
        st = qmp.cmd("query-status").get("status")
        if st != "running":
            raise BenchError(f"after cont and RESUME the VM is {st!r}, not running")

        # Untimed: does the restored guest execute? It should go on to power off (reset).
        ran = {"shutdown_event": None, "console_bytes_after_resume": 0}
        try:
            ev = qmp.wait_event(lambda e: e.get("event") == "SHUTDOWN",
                                time.monotonic() + verify_timeout)
            ran["shutdown_event"] = ev.get("data")
            ran["shutdown_after_resume_ms"] = round((time.monotonic() - t_run) * 1000.0, 1)
        except TimeoutError:
            pass
        serial.flush()
        ran["console_bytes_after_resume"] = os.path.getsize(serial_path)
        ran["console_tail"] = tail(serial_path, 300)
        return {
            "restore_ms": (t_run - t_in) * 1000.0,
            "load_ms": (t_loaded - t_in) * 1000.0,
            "process_to_running_ms": (t_run - t_exec) * 1000.0,
            "process_to_qmp_ready_ms": (t_in - t_exec) * 1000.0,
            "guest": ran,
        }
    except TimeoutError as e:
        raise BenchError(f"restore run {run}: {e} ({timeout:.0f} s); QEMU stderr: "
                         f"{tail(stderr_path)}") from None
    except BenchError as e:
        raise BenchError(f"restore run {run}: {e}; QEMU stderr: {tail(stderr_path)}") from None
    finally:
        if qmp:
            qmp.close()
        kill_tree(proc)
        serial.close()
        errf.close()


# --- main ------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mem-mib", type=int, default=256)
    ap.add_argument("--vcpus", type=int, default=1)
    ap.add_argument("--workdir", help="keeps the snapshot and logs there (default: a temporary "
                    "directory, removed at the end)")
    ap.add_argument("--kernel", default=os.environ.get("AIRLOCK_KERNEL"),
                    help="default: $AIRLOCK_KERNEL")
    ap.add_argument("--rootfs", default=os.environ.get("AIRLOCK_ROOTFS"),
                    help="default: $AIRLOCK_ROOTFS")
    ap.add_argument("--qemu-boot", default=QEMU_BOOT, help="kernel-config/qemu-boot.sh")
    ap.add_argument("--boot-timeout", type=float, default=300)
    ap.add_argument("--restore-timeout", type=float, default=120)
    ap.add_argument("--verify-timeout", type=float, default=15,
                    help="seconds to wait, untimed, for the restored guest to act")
    a = ap.parse_args()
    if not a.kernel or not a.rootfs:
        ap.error("set AIRLOCK_KERNEL and AIRLOCK_ROOTFS (or pass --kernel/--rootfs)")
    for what, p in (("kernel", a.kernel), ("rootfs", a.rootfs)):
        if not os.access(p, os.R_OK):
            ap.error(f"no readable {what} at {p}")
    if a.runs < 1 or a.vcpus < 1 or a.mem_mib < 16:
        ap.error("--runs and --vcpus must be >= 1, --mem-mib >= 16")

    # SIGTERM/SIGHUP end the run through the finally blocks that kill the QEMUs.
    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    temp = a.workdir is None
    workdir = tempfile.mkdtemp(prefix="airlock-qemu-restore-") if temp else a.workdir
    os.makedirs(workdir, exist_ok=True)
    workdir = os.path.abspath(workdir)
    try:
        argv = qemu_argv(a.qemu_boot, a.kernel, a.rootfs, a.vcpus, a.mem_mib, workdir)
        version = qemu_version(argv[0])
        use_file = supports_file_uri(version)
        log(f"QEMU {version}; snapshot via {'file:' if use_file else 'exec:cat'} URI; "
            f"workdir {workdir}")
        snapshot = os.path.join(workdir, "snapshot.mig")
        saved = boot_and_save(argv, workdir, snapshot, a.boot_timeout, use_file)

        restore, to_running, load, to_qmp, guest = [], [], [], [], []
        for i in range(1, a.runs + 1):
            r = restore_once(argv, workdir, snapshot, use_file, i, a.restore_timeout,
                             a.verify_timeout)
            restore.append(r["restore_ms"])
            to_running.append(r["process_to_running_ms"])
            load.append(r["load_ms"])
            to_qmp.append(r["process_to_qmp_ready_ms"])
            guest.append(r["guest"])
            g = r["guest"]
            acted = (f"guest reset {g['shutdown_after_resume_ms']} ms after resume"
                     if g["shutdown_event"] else
                     f"no guest reset within {a.verify_timeout:.0f} s of resume")
            log(f"run {i}/{a.runs}: restore {r['restore_ms']:.1f} ms (load "
                f"{r['load_ms']:.1f}), process->running {r['process_to_running_ms']:.1f} ms; "
                f"{acted}")

        result = {
            "bench": "qemu_restore",
            "qemu_restore_ms": summary(restore),
            "qemu_process_to_running_ms": summary(to_running),
            "qemu_incoming_load_ms": summary(load),
            "qemu_process_to_qmp_ready_ms": summary(to_qmp),
            "mem_mib": a.mem_mib,
            "vcpus": a.vcpus,
            "snapshot_bytes": saved["snapshot_bytes"],
            "qemu_version": version,
            "snapshot_uri": saved["uri"].split(":", 1)[0] + ":",
            "timed_interval": "migrate-incoming sent -> MIGRATION completed -> cont -> RESUME "
                              "event (source stopped before save, so the restore lands paused)",
            "source_boot_to_ready_ms": saved["boot_to_ready_ms"],
            "snapshot_save_ms": saved["save_ms"],
            "guest_ran_after_restore": [bool(g["shutdown_event"]) for g in guest],
            "host": {"machine": platform.machine(), "kernel": platform.release(),
                     "cpus": os.cpu_count(),
                     "kvm": "nested-pvm" if os.path.exists("/sys/module/kvm_pvm")
                     else "bare-metal"},
        }
        print(json.dumps(result), flush=True)
        return 0
    except BenchError as e:
        log(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if temp:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
