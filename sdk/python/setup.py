"""Builds the stubs of `proto/airlock.proto` into `airlock/_proto` while the package is built.

The proto is the one in this repository (`../../proto/airlock.proto`); an sdist carries a copy
(`airlock.proto` next to this file). It is compiled under the package path `airlock/_proto/` so
that the generated modules import each other as `airlock._proto.airlock_pb2`.
"""

import os
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_PROTO = os.path.join(HERE, "..", "..", "proto", "airlock.proto")
LOCAL_PROTO = os.path.join(HERE, "airlock.proto")


def proto_source():
    for p in (REPO_PROTO, LOCAL_PROTO):
        if os.path.exists(p):
            return p
    raise SystemExit("airlock.proto not found (expected at %s)" % REPO_PROTO)


def protobuf_requirement():
    # Generated code checks at import time that the runtime is not older than the generator.
    from google.protobuf import __version__ as v

    return "protobuf>=%s" % v


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        from grpc_tools import protoc
        import grpc_tools

        out = os.path.join(self.build_lib)
        with tempfile.TemporaryDirectory() as tmp:
            pkg = os.path.join(tmp, "airlock", "_proto")
            os.makedirs(pkg)
            shutil.copy(proto_source(), os.path.join(pkg, "airlock.proto"))
            well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
            os.makedirs(os.path.join(out, "airlock", "_proto"), exist_ok=True)
            args = [
                "grpc_tools.protoc",
                "-I" + tmp,
                "-I" + well_known,
                "--python_out=" + out,
                "--pyi_out=" + out,
                "--grpc_python_out=" + out,
                os.path.join(pkg, "airlock.proto"),
            ]
            if protoc.main(args) != 0:
                raise SystemExit("protoc failed on %s" % proto_source())


class SdistWithProto(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        shutil.copy(proto_source(), os.path.join(base_dir, "airlock.proto"))


setup(
    cmdclass={"build_py": BuildWithStubs, "sdist": SdistWithProto},
    install_requires=[
        "grpcio>=1.62",
        protobuf_requirement(),
        "googleapis-common-protos>=1.56",
    ],
)
