"""A DCP stream transform for the tests, like the Rot13 example of PyTorch's own DCP tests
(``torch/testing/_internal/distributed/checkpoint_utils.py``): every byte rotated by 13, so a
stored byte never equals the byte saved in a file of any pattern, and undoing it with the wrong
transform (or none) gives different bytes. A table translation, not a Python loop per byte."""

from __future__ import annotations

import io

from dcp_datastates._dcp_compat import extension_registry, stream_transform_extension_class

_ROT = bytes((b + 13) % 256 for b in range(256))
_UNROT = bytes((b - 13) % 256 for b in range(256))


class Rot13Bytes(stream_transform_extension_class()):
    @staticmethod
    def registry_name() -> str:
        return "test.rot13bytes"

    @staticmethod
    def from_descriptor(version: str) -> "Rot13Bytes":
        if version.partition(".")[0] != "1":
            raise ValueError(f"Unknown extension {version=}")
        return Rot13Bytes()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b) -> int:
                output.write(bytes(b).translate(_ROT))
                return len(memoryview(b))

            def flush(self) -> None:
                output.flush()

            def close(self) -> None:
                if not self.closed:
                    super().close()
                    output.close()

        return Writer()

    def transform_from(self, input):
        class Reader(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def readinto(self, b) -> int:
                data = input.read(len(memoryview(b)))
                if not data:
                    return 0
                memoryview(b)[: len(data)] = data.translate(_UNROT)
                return len(data)

        return Reader()


DESCRIPTOR = "test.rot13bytes/1"


def registry():
    """DCP's default registry (ZStandard) with :class:`Rot13Bytes` registered."""
    reg = extension_registry()
    reg.register(Rot13Bytes)
    return reg
