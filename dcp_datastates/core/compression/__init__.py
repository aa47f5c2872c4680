"""Compressed tensor chunks (zstd): ``DataStatesWriter(path, compression="zstd")``, or
``DataStatesWriter(path, _extensions=[ZStandard()])`` with DCP's own extension object.

Our format fixes every raw tensor's offset when the save is planned, but a
compressed size is known only once the bytes are compressed. So a compressed
chunk is stored like a Python object: it is cut into blocks of
``block_bytes`` raw bytes (4 MiB by default), each block is one zstd frame,
and the frames are appended after the raw tensors; the rank index's object
table (already checksummed, and written last) holds each frame's
``(offset, length)``. What planning fixes is only the ordinal of a chunk's
first block (``ItemLocation(path, -1, raw length, first ordinal)``, after
the objects' ordinals): the block count follows from the raw length, so the
metadata can still be written while the data is.

Why blocks: the frames are compressed in parallel by a thread pool
(``zstandard`` releases the GIL), overlapped with the engine writing the
frames compressed before; and a resharded load decompresses only the blocks
its slice touches. Small tensors (< 64 KiB) stay raw and packed: a frame of
their own would gain nothing. Python objects stay raw too (they are small
and a safe-mode load inspects their pickles).

The layout records ``("zstd", block_bytes)`` in
``CheckpointLayout.compression``; the level is the writer's business only.

DCP's other stream transforms (``_extensions=[...]`` other than ``[ZStandard()]``
alone: an encryption, say) use the same frames (format 9): every tensor
chunk with a byte, small ones too, and every object goes through them, and
the layout records ``("stream", block_bytes, descriptors)``, the descriptors
as DCP records them. :mod:`.transforms` applies and undoes them as DCP does.

:mod:`.codec`: the settings and one frame; :mod:`.transforms`: DCP's stream transforms;
:mod:`.write`: saves; :mod:`.read`: loads.
"""
