"""Looking inside compiled steps: counting all-reduces in HLO text (``_hlo``) and XLA compilations (``_compiles``)."""

from ._compiles import count_compilations as count_compilations
from ._hlo import AllReduceCount as AllReduceCount
from ._hlo import count_all_reduces as count_all_reduces

__all__ = ['AllReduceCount', 'count_all_reduces', 'count_compilations']
