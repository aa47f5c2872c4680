"""CheckpointView and the tools' helpers: block tiling, read-ahead, output/source overlap, progress."""

from __future__ import annotations

import threading

import pytest
import torch

from dcp_datastates.tools.checkpoint_view import CheckpointView, read_ahead, split_box
from dcp_datastates.tools.output import check_output_apart


def test_read_ahead_keeps_order_and_raises_at_the_failing_item():
    assert list(read_ahead(iter(range(50)), depth=2)) == list(range(50))

    def items():
        yield 1
        yield 2
        raise OSError(5, "disk went away")

    got = []
    with pytest.raises(OSError, match="disk went away"):
        for x in read_ahead(items()):
            got.append(x)
    assert got == [1, 2]


def test_read_ahead_stops_its_thread_when_the_consumer_stops_early():
    before = threading.active_count()
    gen = read_ahead(iter(range(1000)))
    assert next(gen) == 0
    gen.close()  # the consumer gives up (an error while writing)
    assert threading.active_count() == before


@pytest.mark.parametrize("shape,itemsize,limit", [((10, 7), 4, 60), ((3, 5, 7), 2, 30), ((9,), 8, 16), ((4, 100), 1, 7)])
def test_split_box_tiles_exactly_within_the_limit(shape, itemsize, limit):
    seen = torch.zeros(shape, dtype=torch.int32)
    for offsets, sizes in split_box((0,) * len(shape), shape, itemsize, limit):
        box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        seen[box] += 1
        n = 1
        for s in sizes:
            n *= s
        assert n * itemsize <= max(limit, sizes[-1] * itemsize)  # at most the limit, or one innermost row
    assert bool((seen == 1).all())


def test_blocks_assemble_sharded_tensors_bit_exactly(sharded_checkpoint):
    view = CheckpointView(sharded_checkpoint.path)
    for key, ref in sharded_checkpoint.tensors.items():
        out = torch.empty_like(ref)
        for offsets, block in view.blocks(key, 256):
            out[tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))] = block
        assert torch.equal(out.view(torch.uint8) if out.dim() else out, ref.view(torch.uint8) if ref.dim() else ref), key


def test_output_may_not_overlap_a_source(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (tmp_path / "link").symlink_to(src)
    for bad in (src, src / ".metadata", tmp_path, tmp_path / "link", tmp_path / "link" / "x.h5"):
        with pytest.raises(ValueError, match="overlap"):
            check_output_apart(str(bad), [str(src)])
    check_output_apart(str(tmp_path / "ckpt2"), [str(src)])  # a sibling sharing a prefix is fine


def test_progress_without_tqdm_draws_nothing_and_still_counts(monkeypatch):
    import sys

    from dcp_datastates.tools.progress import LazyProgress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    with LazyProgress("x") as progress:
        progress(10, 100)
        progress(100, 100)
        assert progress.bar.n == 100
