"""The parts of one split that talk to each other (see `nnscaler.anno.partgroup`).

The interface is defined beside the transform space in `nnscaler.anno`, whose promise
check runs collective part ops; this module keeps the name ops and users import it by.
"""

from nnscaler.anno.partgroup import (
    REDUCE_OPS,
    SINGLE,
    PartGroup,
    PartGroupError,
    ThreadPartGroup,
    check_reduce_op,
    run_parts,
)

__all__ = [
    "REDUCE_OPS",
    "SINGLE",
    "PartGroup",
    "PartGroupError",
    "ThreadPartGroup",
    "check_reduce_op",
    "run_parts",
]
