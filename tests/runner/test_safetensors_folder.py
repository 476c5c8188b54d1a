"""read_into: a safetensors folder read with large reads into a ring of reused buffers, then copied
into the parameters. Folders of mixed dtypes (bf16, fp32, int64, a 0-d tensor) read in pieces far
smaller than their tensors give ``load_file``'s tensors exactly, cast to the parameters' dtypes,
through no more buffers than the ring has; sharded by rows over 2 and 3 gloo ranks (uneven rows,
a rank with none) each rank reads the bytes of its rows only, and a shard on another dimension
still reads through get_slice; a folder that does not fit the model, a dtype not read, a header
or file that does not hold up, and a failing read are SafetensorsErrors naming them; on a GPU
the same, through page-locked buffers.
"""

from __future__ import annotations

import json
import os
import struct
import threading

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from distlib.runner.hf import safetensors_folder as sf  # noqa: E402
from distlib.runner.hf.safetensors_folder import SafetensorsError, read_into  # noqa: E402
from tests.conftest import run_ranks  # noqa: E402

SMALL = 4096  # bytes of a read in these tests: several per tensor

STORED = {  # name -> what the file holds: a matrix bigger than SMALL, other dtypes, a 0-d tensor
    "big": ((700, 17), torch.bfloat16),  # 23800 bytes: six reads
    "w": ((37, 11), torch.float32),
    "steps": ((13,), torch.int64),
    "odd": ((3,), torch.bfloat16),  # 6 bytes: what follows it in a file is not 4-aligned unless the writer pads
    "scale": ((), torch.float32),
}


def make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in STORED.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)
    return out


class Holder(nn.Module):
    """A parameter or persistent buffer per name, of the given shape and dtype, filled with a value
    no file has (so a tensor left unread shows)."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], buffers: tuple[str, ...] = ()):
        super().__init__()
        for name, (shape, dtype) in specs.items():
            t = torch.full(shape, 7, dtype=dtype)
            if name in buffers:
                self.register_buffer(name, t)
            else:
                self.register_parameter(name, nn.Parameter(t, requires_grad=dtype.is_floating_point))


class Counting:
    """os.preadv and the ring's buffers, counted: the bytes and sizes of the reads, the buffers made."""

    def __init__(self, monkeypatch):
        self.reads: list[int] = []
        self.buffers = 0
        real_preadv, real_buffer = os.preadv, sf._Buffer

        def preadv(fd, buffers, offset, *args):
            n = real_preadv(fd, buffers, offset, *args)
            self.reads.append(n)
            return n

        def buffer(*args, **kwargs):
            self.buffers += 1
            return real_buffer(*args, **kwargs)

        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(sf, "_Buffer", buffer)


def write_sharded(directory, tensors: dict[str, torch.Tensor], groups: list[list[str]]) -> None:
    """The tensors in one file per group, named by an index as save_pretrained names them."""
    os.makedirs(directory, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, os.path.join(directory, file))
        weight_map.update(dict.fromkeys(names, file))
    with open(os.path.join(directory, sf.INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---- whole tensors -------------------------------------------------------------------------------
def test_mixed_dtypes_read_in_pieces_through_the_reused_ring_equal_load_file(tmp_path, monkeypatch):
    """Reads of at most SMALL bytes, more of them than the ring has buffers (so the buffers are
    refilled), each tensor whole: the module holds load_file's tensors exactly; the bytes
    returned and read are the tensors'."""
    tensors = make_tensors()
    save_file(tensors, str(tmp_path / sf.SINGLE))
    monkeypatch.setattr(sf, "PIECE", SMALL)
    counted = Counting(monkeypatch)
    module = Holder(STORED, buffers=("steps",))
    read = read_into(module, str(tmp_path))
    expected = load_file(str(tmp_path / sf.SINGLE))
    for name, t in module.state_dict().items():
        assert t.dtype == expected[name].dtype and torch.equal(t, expected[name]), name
    assert read == nbytes(expected.values()) == sum(counted.reads)
    assert max(counted.reads) <= SMALL and len(counted.reads) > sf.BUFFERS
    assert counted.buffers == sf.BUFFERS


def test_the_parameters_dtype_is_kept_the_files_cast_to_it(tmp_path, monkeypatch):
    """bf16 in the file into fp32 parameters, fp32 into bf16, int64 into an fp64 buffer: each as
    ``.to(dtype)`` of load_file's tensor; the bytes read are the file's."""
    tensors = make_tensors(1)
    save_file(tensors, str(tmp_path / sf.SINGLE))
    monkeypatch.setattr(sf, "PIECE", SMALL)
    to = {"big": torch.float32, "w": torch.bfloat16, "steps": torch.float64, "odd": torch.float32,
          "scale": torch.float64}  # fmt: skip
    module = Holder({n: (shape, to[n]) for n, (shape, _) in STORED.items()}, buffers=("steps",))
    read = read_into(module, str(tmp_path))
    expected = load_file(str(tmp_path / sf.SINGLE))
    for name, t in module.state_dict().items():
        assert t.dtype == to[name] and torch.equal(t, expected[name].to(to[name])), name
    assert read == nbytes(expected.values())


def test_a_sharded_folder_with_tied_names_reads_each_file_in_order(tmp_path, monkeypatch):
    """Three files named by an index, one tensor under one of two names of a tied parameter: every
    tensor read once, from its file; a large piece size reads each file's adjacent tensors in one
    read each."""
    tensors = make_tensors(2)
    write_sharded(tmp_path, tensors, [["big", "odd"], ["w"], ["steps", "scale"]])
    counted = Counting(monkeypatch)
    module = Holder(STORED, buffers=("steps",))
    module.tied = module.big  # a second name of one parameter: the files have one of them
    read = read_into(module, str(tmp_path))
    for name, t in tensors.items():
        assert torch.equal(module.state_dict()[name], t), name
    assert module.tied is module.big
    assert read == nbytes(tensors.values()) == sum(counted.reads)
    assert len(counted.reads) == 3 and counted.buffers == 3  # one read per file


def test_a_writer_that_does_not_align_the_tensors_is_read_too(tmp_path, monkeypatch):
    """A file written by hand with a 6-byte bf16 tensor before an fp32 one (the fp32 bytes at an
    offset that is not a multiple of 4): the fp32 tensor starts a read of its own and reads right."""
    odd, w = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16), torch.arange(5, dtype=torch.float32) / 3
    raw = [odd.view(torch.uint8).numpy().tobytes(), w.view(torch.uint8).numpy().tobytes()]
    header = {"odd": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
              "w": {"dtype": "F32", "shape": [5], "data_offsets": [6, 26]}}  # fmt: skip
    write_raw(tmp_path / sf.SINGLE, header, b"".join(raw))
    counted = Counting(monkeypatch)
    module = Holder({"odd": ((3,), torch.bfloat16), "w": ((5,), torch.float32)})
    assert read_into(module, str(tmp_path)) == 26
    assert torch.equal(module.odd, odd) and torch.equal(module.w, w)
    assert counted.reads == [6, 20]


# ---- sharded by rows ----------------------------------------------------------------------------
ROWS = {  # rows that 2 and 3 ranks do not divide evenly; one with fewer rows than 3 ranks
    "emb": ((11, 7), torch.bfloat16),
    "proj": ((10, 3), torch.float32),
    "norm": ((2,), torch.float32),
    "counts": ((5, 2), torch.int64),
    "col": ((4, 9), torch.float32),  # sharded on dimension 1: read through get_slice
    "whole": ((3, 3), torch.float32),  # not a DTensor: every rank reads it all
}


def row_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {n: (torch.randn(s, generator=g) * 100).to(d) for n, (s, d) in ROWS.items()}


def _read_sharded(ctx, directory: str, to_dtype: str) -> dict:
    """This rank's local parts after read_into into DTensors (Shard(0), one Shard(1)) of zeros, the
    bytes it returned and the bytes its preadv calls read."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sf.PIECE = 64  # several reads for most ranks' rows
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    module = nn.Module()
    for name, (shape, dtype) in ROWS.items():
        dtype = getattr(torch, to_dtype) if dtype.is_floating_point and to_dtype else dtype
        zeros = torch.zeros(shape, dtype=dtype)
        t = zeros if name == "whole" else distribute_tensor(zeros, mesh, [Shard(1 if name == "col" else 0)])
        module.register_parameter(name, nn.Parameter(t, requires_grad=False))
    reads, real = [], os.preadv

    def preadv(fd, buffers, offset, *args):
        reads.append(real(fd, buffers, offset, *args))
        return reads[-1]

    os.preadv = preadv
    try:
        read = read_into(module, directory)
    finally:
        os.preadv = real
    local = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in module.named_parameters()}
    return {"local": local, "read": read, "preadv": sum(reads)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("to_dtype", ["", "float64"])
def test_sharded_by_rows_each_rank_reads_the_bytes_of_its_rows(tmp_path, world_size, to_dtype):
    """Over 2 and 3 gloo ranks, torch.chunk's rows (the last rank short, or with none): each rank's
    local part is its rows of the file's tensor (cast when the parameters are fp64); the bytes it
    reads with preadv are those of its rows (and the whole unsharded tensor) only, and with the
    column shard's elements (get_slice) make what read_into returns; the ranks' row reads add up
    to the file's sharded tensors once."""
    tensors = row_tensors()
    write_sharded(tmp_path, tensors, [["emb", "norm", "col"], ["proj", "counts", "whole"]])
    got = run_ranks(_read_sharded, world_size, str(tmp_path), to_dtype, timeout=120)
    rowwise = [n for n in ROWS if n not in ("col", "whole")]
    for rank, g in enumerate(got):
        parts = {n: torch.chunk(t, world_size, dim=1 if n == "col" else 0) for n, t in tensors.items()}
        expected = {n: (p[rank] if rank < len(p) else p[0][:0]) for n, p in parts.items()}
        expected["whole"] = tensors["whole"]
        for name, want in expected.items():
            have = g["local"][name]
            assert have.shape == want.shape, (rank, name)
            assert torch.equal(have, want.to(have.dtype)), (rank, name)
        rows = nbytes(expected[n] for n in rowwise)
        assert g["preadv"] == rows + nbytes([tensors["whole"]]), (rank, g["preadv"])
        assert g["read"] == g["preadv"] + nbytes([expected["col"]]), rank
    assert sum(g["preadv"] - nbytes([tensors["whole"]]) for g in got) == nbytes(tensors[n] for n in rowwise)


# ---- what is refused -----------------------------------------------------------------------------
def write_raw(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def test_names_and_shapes_that_do_not_fit_the_model_are_errors_naming_them(tmp_path):
    save_file(make_tensors(), str(tmp_path / sf.SINGLE))
    other = dict(STORED, w=((11, 37), torch.float32))
    with pytest.raises(SafetensorsError, match=r"w has shape \[37, 11\], the model's is \[11, 37\]"):
        read_into(Holder(other), str(tmp_path))
    fewer = {k: v for k, v in STORED.items() if k != "odd"}
    with pytest.raises(SafetensorsError, match=r"1 unknown to the model: odd"):
        read_into(Holder(fewer), str(tmp_path))
    with pytest.raises(SafetensorsError, match=r"missing 1 tensor\(s\): extra"):
        read_into(Holder(dict(STORED, extra=((2,), torch.float32))), str(tmp_path))


def test_a_dtype_not_read_a_bad_header_a_short_file_and_a_failed_read_are_errors(tmp_path, monkeypatch):
    """Files named by an index (a single model.safetensors is opened by safetensors first, to list
    its names): each mistake an error naming the file and the tensor."""
    module = Holder({"w": ((2,), torch.float32)})
    write_sharded(tmp_path, {"w": torch.zeros(2)}, [["w"]])
    path = tmp_path / "model-00001-of-00001.safetensors"
    write_raw(path, {"w": {"dtype": "F4X", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(SafetensorsError, match=r"w is stored as 'F4X', a dtype not read here"):
        read_into(module, str(tmp_path))
    write_raw(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(8))
    with pytest.raises(SafetensorsError, match=r"w takes 4 bytes, not the 8 of \[2\] F32"):
        read_into(module, str(tmp_path))
    write_raw(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(5))  # cut short
    with pytest.raises(SafetensorsError, match=r"unreadable \(ValueError: w: bytes 0 to 8 of data that has 5\)"):
        read_into(module, str(tmp_path))
    path.write_bytes(struct.pack("<Q", 9) + b"{not json")
    with pytest.raises(SafetensorsError, match=r"unreadable \(JSONDecodeError"):
        sf._data_offsets(str(path))

    write_raw(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    threads = threading.active_count()

    def failing(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(SafetensorsError, match=r"00001.safetensors: unreadable \(OSError: \[Errno 5\] Input/"):
        read_into(module, str(tmp_path))
    assert threading.active_count() == threads  # the reading thread ended


def test_an_error_while_copying_stops_the_reading_thread(tmp_path, monkeypatch):
    """A copy that fails in the calling thread (here a bad buffer view) ends the reader, which
    was waiting for a free buffer, and the error is raised as it was."""
    save_file(make_tensors(), str(tmp_path / sf.SINGLE))
    monkeypatch.setattr(sf, "PIECE", SMALL)
    threads = threading.active_count()
    real = sf._Buffer

    def broken(*args, **kwargs):
        b = real(*args, **kwargs)
        b.tensor = b.tensor[:1]  # one byte: no view of it as the file's dtypes
        return b

    monkeypatch.setattr(sf, "_Buffer", broken)
    with pytest.raises(RuntimeError):
        read_into(Holder(STORED, buffers=("steps",)), str(tmp_path))
    assert threading.active_count() == threads


# ---- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.gpus(1)
def test_on_a_gpu_through_page_locked_buffers_reused_after_their_copies(tmp_path, monkeypatch):
    """CUDA parameters (fp32 and bf16, the file's bf16 and fp32 cast on the GPU), reads of 4 KiB
    through three pinned buffers refilled many times: load_file's tensors exactly."""
    g = torch.Generator().manual_seed(4)
    tensors = {"a": torch.randn(1000, 64, generator=g).to(torch.bfloat16), "b": torch.randn(513, 31, generator=g),
               "c": torch.randint(0, 1000, (77,), generator=g)}  # fmt: skip
    save_file(tensors, str(tmp_path / sf.SINGLE))
    monkeypatch.setattr(sf, "PIECE", SMALL)
    pinned = []
    real = sf._Buffer

    def buffer(*args, **kwargs):
        pinned.append(kwargs["pinned"])
        return real(*args, **kwargs)

    monkeypatch.setattr(sf, "_Buffer", buffer)
    to = {"a": torch.float32, "b": torch.bfloat16, "c": torch.int64}
    with torch.device("cuda"):
        module = Holder({n: (tuple(t.shape), to[n]) for n, t in tensors.items()}, buffers=("c",))
    read = read_into(module, str(tmp_path))
    assert pinned == [True] * sf.BUFFERS
    for name, t in tensors.items():
        assert torch.equal(module.state_dict()[name].cpu(), t.to(to[name])), name
    assert read == nbytes(tensors.values())
