"""The cache-side state of ``guard_cache``: which blocks of which tensors hold poison or a
checksum, and the batched reads that verify them on the tensor's own device.

``PoolState`` is one pool's blocks across its tensors; tensors of one device and bit width form a
``Group``, read in one reduction per hand-out; ``Entry`` is one tensor seen as blocks along its
block dimension; ``Selection`` is the ids of one call, read as a few runs of consecutive ids or
gathered by an index. Poison is written and compared as the integer its bits read as
(``poison_bits``), so NaN compares equal to itself and fp8 needs no arithmetic.
"""

from __future__ import annotations

MAX_RUNS = 2
"""Up to this many runs of consecutive ids, blocks are read through views of the cache (no index
tensor to upload); beyond, one ``index_select`` per tensor gathers them."""

SENTINEL_BYTES = {"torch.int8": 0x80, "torch.uint8": 0xA5}
"""Poison of the 1-byte integer dtypes: -128 lies outside symmetric int8 quantization's range;
uint8 has no unused value, so a pattern a real cache rarely fills a whole block with."""


class PoolState:
    """The tensors of one sub-pool, grouped for batched checks, and its pending free blocks."""

    def __init__(self, pool, refcounted: bool) -> None:
        self.pool = pool
        self.refcounted = refcounted
        self.sites: dict = {}
        """Pending block -> (allocation site, free site) of its last owner: a report names who
        most likely still writes to it."""
        self.entries: list = []
        self.groups: list = []
        self.extent = 0
        self.marks = bytearray()
        self.evict_poison = False

    def add(self, entries) -> None:
        self.entries += entries
        self.extent = min(e.blocks for e in self.entries)
        if len(self.marks) < self.extent:
            self.marks.extend(bytes(self.extent - len(self.marks)))
        self.evict_poison = self.refcounted and any(e.poison for e in self.entries)
        groups = {}
        for e in self.entries:
            checksum = self.refcounted or not e.poison
            key = (e.device, checksum, e.bits.dtype, e.width, None if checksum else e.pattern)
            if key not in groups:
                groups[key] = Group(e.device, checksum, e.pattern, e.width, self.extent)
            groups[key].entries.append(e)
        self.groups = list(groups.values())
        for group in self.groups:
            group.layout()


class Group:
    """Tensors on one device whose blocks one reduction can check together."""

    def __init__(self, device, checksum, pattern, width, extent) -> None:
        self.device = device
        self.checksum = checksum
        self.pattern = pattern
        self.width = width
        self.extent = extent
        self.entries: list = []
        self.offsets: list = []
        self.rows = 0
        self.table = None

    def layout(self) -> None:
        self.offsets, rows = [], 0
        for e in self.entries:
            self.offsets.append(rows)
            rows += e.rows
        self.rows = rows

    def gather(self, sel):
        """The selected blocks of every tensor, one per line ``[rows * n, width]``: tensor, then
        row, then block. One ``cat`` copies them all (slices may be strided)."""
        import torch

        pieces = []
        for e in self.entries:
            e.pieces(sel, pieces)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def sums(self, sel):
        return self.gather(sel).sum(1).view(self.rows, sel.n)

    def store(self, sel) -> None:
        """Take the checksums of freed blocks, kept on the device (no sync)."""
        import torch

        sums = self.sums(sel)
        if self.table is None:
            self.table = torch.zeros((self.rows, self.extent), dtype=torch.int64,
                                     device=self.device)
        if sel.use_runs:
            for a, b, col in sel.runs:
                self.table[:, a:b].copy_(sums[:, col:col + b - a])
        else:
            self.table.index_copy_(1, sel.index(self.device), sums)

    def stored(self, sel):
        import torch

        if sel.use_runs:
            parts = [self.table[:, a:b] for a, b, _ in sel.runs]
            return parts[0] if len(parts) == 1 else torch.cat(parts, 1)
        return self.table.index_select(1, sel.index(self.device))

    def check(self, sel):
        """``(ok, detail)``: ok a 0-dim bool on the device; detail what culprits() needs."""
        if self.checksum:
            diff = self.sums(sel) != self.stored(sel)
            return ~diff.any(), diff
        flat = self.gather(sel)
        return flat.eq(self.pattern).all(), flat

    def culprits(self, sel, detail):
        """(block, entry) for every tensor whose copy of a block changed (after a failed check)."""
        out = []
        if self.checksum:
            bad = detail.tolist()
            for e, off in zip(self.entries, self.offsets):
                for k, b in enumerate(sel.ids):
                    if any(bad[r][k] for r in range(off, off + e.rows)):
                        out.append((b, e))
            return out
        start = 0
        for e in self.entries:
            size = e.rows * sel.n
            part = detail[start:start + size].view(e.rows, sel.n, e.width)
            start += size
            intact = part.eq(self.pattern).all(2).all(0).tolist()
            out += [(b, e) for b, ok in zip(sel.ids, intact) if not ok]
        return out


class Entry:
    """One cache tensor as the checks see it: its bits viewed ``[rows, blocks, width]``."""

    def __init__(self, name, tensor, block_dim, poison, pool_size, torch) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"cache tensor {name!r} is a {type(tensor).__name__}, not a "
                            "torch.Tensor")
        dtype = tensor.dtype
        if dtype == torch.bool or dtype.is_complex or dtype.itemsize not in BITS:
            raise TypeError(f"cache tensor {name!r} has dtype {dtype}: kvguard poisons float, "
                            "fp8 and integer caches")
        if isinstance(block_dim, bool) or not isinstance(block_dim, int):
            raise TypeError(f"block_dim must be an int, not {block_dim!r}")
        ndim = tensor.dim()
        if not -ndim <= block_dim < ndim:
            raise ValueError(f"block_dim={block_dim} is out of range for cache tensor {name!r} "
                             f"of shape {tuple(tensor.shape)}")
        block_dim %= ndim
        self.name = name
        self.tensor = tensor
        self.block_dim = block_dim
        self.device = tensor.device
        self.poison = poison
        self.blocks = tensor.shape[block_dim]
        if tensor.numel() == 0:
            raise ValueError(f"cache tensor {name!r} is empty (shape {tuple(tensor.shape)})")
        if pool_size is not None and self.blocks < pool_size:
            raise ValueError(
                f"cache tensor {name!r} has {self.blocks} blocks along dim {block_dim} (shape "
                f"{tuple(tensor.shape)}) but the pool has {pool_size}: is block_dim right?")
        self.bits = tensor.detach().view(getattr(torch, BITS[dtype.itemsize]))
        self.pattern = poison_bits(dtype, torch)
        lead = 1
        for size in tensor.shape[:block_dim]:
            lead *= size
        width = 1
        for size in tensor.shape[block_dim + 1:]:
            width *= size
        try:
            canon = self.bits.view(lead, self.blocks, width)
        except RuntimeError:
            canon = None
        # A view [rows, blocks, width] reads a block run as slices; other layouts are gathered
        # and flattened block by block (rows=1).
        self.canon = canon
        self.row_views = list(canon.unbind(0)) if canon is not None else None
        self.rows = lead if canon is not None else 1
        self.width = width if canon is not None else lead * width

    def pieces(self, sel, out) -> None:
        """Append this tensor's selected blocks to ``out`` as 2-D ``[blocks, width]`` pieces,
        row by row: slices of the view for a few runs, one gather otherwise."""
        if self.row_views is not None and sel.use_runs:
            runs = sel.runs
            for row in self.row_views:
                for a, b, _ in runs:
                    out.append(row[a:b])
            return
        idx = sel.index(self.device)
        if self.canon is not None:
            out.append(self.canon.index_select(1, idx).flatten(0, 1))
        else:
            picked = self.bits.index_select(self.block_dim, idx)
            out.append(picked.movedim(self.block_dim, 0).reshape(sel.n, -1))

    def fill(self, sel) -> None:
        if self.canon is not None and sel.use_runs:
            for a, b, _ in sel.runs:
                self.canon[:, a:b].fill_(self.pattern)
        else:
            self.bits.index_fill_(self.block_dim, sel.index(self.device), self.pattern)


class Selection:
    """The ids of one call, sorted, as runs of consecutive blocks and (lazily) an index tensor
    per device, uploaded from pinned memory so a CUDA copy does not wait for the device."""

    __slots__ = ("ids", "n", "runs", "use_runs", "_index")

    def __init__(self, ids) -> None:
        self.ids = ids
        self.n = len(ids)
        runs = []
        start = prev = ids[0]
        col = 0
        for b in ids[1:]:
            if b != prev + 1:
                runs.append((start, prev + 1, col))
                col += prev + 1 - start
                start = b
            prev = b
        runs.append((start, prev + 1, col))
        self.runs = runs
        self.use_runs = len(runs) <= MAX_RUNS
        self._index = {}

    def index(self, device):
        idx = self._index.get(device)
        if idx is None:
            import torch

            if device.type == "cpu":
                idx = torch.tensor(self.ids, dtype=torch.long)
            elif device.type == "cuda":
                idx = torch.tensor(self.ids, dtype=torch.long, pin_memory=True).to(
                    device, non_blocking=True)
            else:
                idx = torch.tensor(self.ids, dtype=torch.long, device=device)
            self._index[device] = idx
        return idx


BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
"""The integer dtype a cache is read as, by element size: checks compare bits, not values."""


def poison_bits(dtype, torch) -> int:
    """The poison of ``dtype`` as the integer its bits read as (see ``BITS``)."""
    bits = getattr(torch, BITS[dtype.itemsize])
    if dtype.is_floating_point:
        nan = torch.tensor([float("nan")]).to(dtype)
        if torch.isnan(nan.float()).all():
            return int(nan.view(bits).item())
        return 0xA5  # a float format without NaN (none in torch today)
    if dtype.itemsize == 1:
        return SENTINEL_BYTES.get(str(dtype), 0xA5)
    return torch.iinfo(bits).min


def tombstones(ledger, extent, torch) -> list:
    """Blocks the ledger saw freed and not handed out since: free for certain."""
    n = min(len(ledger.stamp), extent)
    if not n:
        return []
    stamp = torch.frombuffer(ledger.stamp, dtype=torch.int64)[:n]
    return torch.nonzero(stamp < 0).flatten().tolist()
