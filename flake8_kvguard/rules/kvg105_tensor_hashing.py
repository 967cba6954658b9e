"""KVG105: de-duplication or membership by tensor identity.

The elements of a tensor are 0-dim tensors, and a tensor hashes by identity: `set(t)`
keeps every element, two equal ids are two dict keys, and `t[i] in seen` is False
for a `seen` full of ints. Convert to Python ints first.
"""

CODE = "KVG105"
SUMMARY = "de-duplication or membership by tensor identity: set(tensor), dict keys, in"
MESSAGE = (
    "KVG105 {what} over torch tensor elements: 0-dim tensors hash by identity, so equal "
    "ids never match and nothing is de-duplicated; convert with .tolist() first"
)
FIXABLE = True

BAD = [
    """\
import torch

def unique_blocks(block_table: torch.Tensor) -> int:
    return len(set(block_table[0]))
""",
    """\
import torch

def owners(block_ids: torch.Tensor) -> dict:
    return dict.fromkeys(block_ids)
""",
    """\
import torch

def still_used(block_ids: torch.Tensor, freed: list) -> list:
    gone = set(freed)
    return [b for b in block_ids if b not in gone]
""",
]
FIXED = [
    """\
import torch

def unique_blocks(block_table: torch.Tensor) -> int:
    return len(set(block_table[0].tolist()))
""",
    """\
import torch

def owners(block_ids: torch.Tensor) -> dict:
    return dict.fromkeys(block_ids.tolist())
""",
    None,
]
GOOD = [
    """\
import torch

def unique_blocks(block_table: torch.Tensor) -> int:
    return len(set(block_table[0].tolist()))
""",
    """\
import torch

def still_used(block_ids: torch.Tensor, freed: list) -> list:
    gone = set(freed)
    return [b for b in block_ids.tolist() if b not in gone]
""",
]


def check_hash_use(use, ctx):
    ctx.report(CODE, use.node, MESSAGE.format(what=use.what), fix=use.fix)
