"""Writes a pure-Python wheel: python3 mkwheel.py OUT_DIR NAME VERSION [PAD_BYTES].

The package's module `NAME` (dashes as underscores) holds `VALUE = "hello from NAME VERSION"`
and, with PAD_BYTES, a data file of that many random bytes (stored, so the wheel is about that
large). Prints the wheel's path and its SHA-256.
"""
import base64
import hashlib
import os
import sys
import zipfile


def record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def main():
    out, name, version = sys.argv[1], sys.argv[2], sys.argv[3]
    pad = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    mod = name.replace("-", "_")
    dist = f"{mod}-{version}.dist-info"
    files = {
        f"{mod}/__init__.py": f'VALUE = "hello from {name} {version}"\n'.encode(),
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            "Summary: an Airlock test package\n"
        ).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: airlock-mkwheel\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if pad:
        files[f"{mod}/pad.bin"] = os.urandom(pad)
    record = [record_line(p, d) for p, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{mod}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for p, d in files.items():
            z.writestr(zipfile.ZipInfo(p, date_time=(2026, 1, 1, 0, 0, 0)), d)
    with open(path, "rb") as f:
        print(path, hashlib.sha256(f.read()).hexdigest())


main()
