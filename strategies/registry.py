"""The registry: every piece of parallelism, in the order they are applied (torchtitan's: the pipeline cuts the
model first, then on each stage tensor parallelism -> context parallelism -> expert parallelism -> activation
checkpointing -> torch.compile -> FSDP or replicate; then fault tolerance across replica groups), and the engines
that replace them all (DeepSpeed's ZeRO, chosen by the accelerate config). The flags (strategies/args.py), the
refusals, parallelize, the theory, the Job's hooks and the tests iterate over `PIECES`; nothing else names a piece.

A new piece is one module with one `Piece` subclass (strategies/piece.py), added here, or at run time with
`register` before strategies.args is imported (its flags are made from the registry then): tests/
test_one_module.py plugs a toy piece in that way, from the test file alone.
"""

from __future__ import annotations

import sys

from strategies import activation_checkpointing, compile, cp, deepspeed, ep, ft, pp, replicate, shard, tp

PIECES = (
    pp.PIECE,
    tp.PIECE,
    cp.PIECE,
    ep.PIECE,
    activation_checkpointing.PIECE,
    compile.PIECE,
    shard.PIECE,
    replicate.PIECE,
    ft.PIECE,  # fault tolerance: torchft across the groups, each one launch of the layout above
)
ENGINES = (deepspeed.ENGINE,)


def register(piece, before: str | None = None) -> None:
    """Add `piece` to the registry (before the piece named `before`, else last). Its flags join the CLI only
    if strategies.args has not been imported yet: registering later is refused, not silently flagless."""
    global PIECES
    if "strategies.args" in sys.modules:
        raise RuntimeError(f"register({piece.name!r}) after strategies.args was imported: its flags are made from "
                           "the registry at import; register pieces first")  # fmt: skip
    names = [p.name for p in PIECES]
    at = names.index(before) if before else len(PIECES)
    PIECES = (*PIECES[:at], piece, *PIECES[at:])
