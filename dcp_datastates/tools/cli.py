"""``dcp-datastates``: list, inspect, verify, convert, export and compare checkpoints.

Each subcommand parses its arguments here and runs the module of
:mod:`tools.commands` named after it, which calls a library function of its
own, so everything the tool does is also available from Python. This is the
entry point: it imports the commands, and none of them imports it (what they
share is in ``common``). :func:`run` is the in-process entry; :func:`main`,
the program, also sets the process's heap for streaming.
Errors are reported as one line on stderr with a non-zero exit status; a
traceback is printed only with ``--debug``. Exit status: 0 success, 1 a
failure (a checkpoint that does not verify, an unreadable file, a refused
conversion), 2 a usage error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
import warnings

from dcp_datastates.tools.common import PROG, one_line


def _size(text: str) -> int:
    """``5GB``, ``500MiB``, ``1048576`` -> bytes (decimal and binary suffixes)."""
    units = {
        "": 1, "B": 1,
        "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
        "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
        "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
    }
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1048576)") from None
    if unit not in units or value <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1048576)")
    return int(value * units[unit])


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from dcp_datastates import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify, convert, export and compare dcp_datastates checkpoints "
        "(and stock torch.distributed.checkpoint ones).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="print a traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=description or help_text)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="print a traceback on errors")
        return p

    def allow_pickle(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--allow-pickle", action="store_true",
            help="unpickle saved Python objects without restriction (only for checkpoints you trust)",
        )

    def latest(p: argparse.ArgumentParser) -> None:
        p.add_argument("--latest", action="store_true", help="of a run root, only the step its latest pointer names")

    p = add("ls", "list the checkpoints under a directory or a durable tier: steps, sizes, committed or not")
    p.add_argument("root", metavar="ROOT", help="a directory of checkpoints (e.g. a CheckpointManager root), one "
                   "checkpoint, or a durable tier (s3://bucket/prefix)")
    p.add_argument("--durable", metavar="URL", help="also show each step's state on this durable tier (a directory or "
                   "s3://bucket/prefix): committed, draining, incomplete, or - (not there)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = add("inspect", "show every key of a checkpoint: dtype, global shape, chunks, bytes, rank files")
    p.add_argument("ckpt", metavar="CKPT", help="a checkpoint directory (ours or stock DCP), or its s3:// URL (ours); "
                   "a run root (a directory of step directories, or s3://bucket/prefix): each committed step")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--chunks", action="store_true", help="list every saved chunk (box, file, offset, bytes)")
    latest(p)

    p = add("verify", "check every checksum of checkpoints; exit status 1 on any fault")
    p.add_argument("ckpts", metavar="CKPT", nargs="+", help="checkpoint directories, or durable copies: "
                   "s3://bucket/prefix/step_N (one); run roots: a directory of step directories, or "
                   "s3://bucket/prefix (every committed step)")
    allow_pickle(p)
    latest(p)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--digests", action="store_true", help="also recompute the content digests incremental "
                   "saves trust (XXH3-128 of every chunk that records one; format 8)")

    p = add("du", "disk usage of checkpoints: their files, and stray files safe to delete")
    p.add_argument("paths", metavar="PATH", nargs="+", help="checkpoint directories, directories of checkpoints, "
                   "or durable tiers (s3://bucket/prefix[/step_N])")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = add(
        "convert", "convert a checkpoint to torch.save, sharded safetensors, stock DCP or a Hugging Face model "
        "directory; or from stock DCP or Hugging Face to ours",
        "Convert a checkpoint, streaming tensor by tensor (memory is bounded by the largest tensor, "
        "not the checkpoint). --to torch: one torch.save file; --to safetensors: HF-style shards "
        "plus model.safetensors.index.json; --to dcp: DCP's FileSystemWriter format; --to datastates: "
        "a stock DCP checkpoint or a Hugging Face directory into ours; --to huggingface: the model part, "
        "as transformers' from_pretrained loads it.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="the checkpoint to convert (a directory, or its s3:// URL), or a "
                   "Hugging Face model directory (safetensors)")
    p.add_argument("--to", required=True, choices=["torch", "safetensors", "dcp", "datastates", "huggingface"],
                   help="output format (huggingface: what transformers' from_pretrained loads, docs/huggingface.md)")
    p.add_argument("out", metavar="OUT", help="output file (torch) or directory (the others)")
    p.add_argument("--max-shard-size", type=_size, default=_size("5GB"), help="safetensors shard size (default 5GB)")
    p.add_argument("--prefix", metavar="KEY", help="huggingface: the state's entry holding the model (default model), "
                   "stripped from the names; from a Hugging Face directory: the entry its tensors go under")
    p.add_argument("--config", metavar="DIR", help="huggingface: a directory with the model's config.json (and "
                   "tokenizer): tensors checked against it, tied weights stored once, its files copied")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="huggingface: cast floating-point weights")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    allow_pickle(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")

    p = add(
        "export", "export checkpoints to HDF5 or zarr for analysis (one dataset per key, a step axis)",
        "Export one or more checkpoints of a run into one HDF5 file or zarr store: one dataset per "
        "tensor with its full (unsharded) shape and a leading step axis, written block by block from "
        "the saved shards. bfloat16 and float8 values are stored as their raw bits (see docs/cli.md).",
    )
    p.add_argument("ckpts", metavar="CKPT", nargs="+", help="checkpoints (directories or s3:// URLs), in step order")
    p.add_argument("--format", required=True, choices=["hdf5", "zarr"], help="output format")
    p.add_argument("--out", "-o", required=True, metavar="OUT", help="output .h5 file or zarr directory")
    p.add_argument("--keys", metavar="GLOB", action="append", help="only keys matching this glob (repeatable)")
    p.add_argument("--block-bytes", type=_size, default=_size("256MiB"), help="largest block read at once (default 256MiB)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = add("diff", "per-tensor relative change between two checkpoints, top movers, optional plot")
    p.add_argument("a", metavar="CKPT_A", help="the earlier checkpoint (a directory or an s3:// URL)")
    p.add_argument("b", metavar="CKPT_B", help="the later checkpoint (a directory or an s3:// URL)")
    p.add_argument("--top", type=_positive_int, default=10, metavar="K", help="how many top movers to list (default 10)")
    p.add_argument("--keys", metavar="GLOB", action="append", help="only keys matching this glob (repeatable)")
    p.add_argument("--plot", metavar="PNG", help="write a plot of relative change per layer (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--block-bytes", type=_size, default=_size("256MiB"), help="largest block read at once (default 256MiB)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    allow_pickle(p)
    return parser


def run(argv: list[str] | None = None, stdout=None, stderr=None) -> int:
    """Parse ``argv`` and run the command, writing to ``stdout`` and ``stderr`` (the process's
    streams when not given); return the exit status. Leaves the process's settings as they
    were (the in-process entry tests and scripts use; :func:`main` is the program's)."""
    with contextlib.ExitStack() as stack:
        if stdout is not None:
            stack.enter_context(contextlib.redirect_stdout(stdout))
        if stderr is not None:
            stack.enter_context(contextlib.redirect_stderr(stderr))
        stack.enter_context(warnings.catch_warnings())
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help, --version, a usage error (already printed)
            return exc.code if isinstance(exc.code, int) else 2
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return importlib.import_module(f"dcp_datastates.tools.commands.{args.command}").run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dcp-datastates inspect X | head`: no more output, and none at exit
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and a status
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"{PROG} {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """The ``dcp-datastates`` program: the process's heap set for streaming (memory bounded by a
    block, not by the bytes streamed, see :mod:`native.memory`), then :func:`run`."""
    from dcp_datastates.native.memory import bound_heap

    bound_heap()
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
