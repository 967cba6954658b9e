"""The rules, one module each; this table is the rule set.

Every rule module has a CODE, a one-line SUMMARY, the MESSAGE template it reports
(what is wrong and what to do), whether it can FIX what it finds, and its examples:
BAD snippets that it must flag, GOOD ones it must leave alone and, for fixable
rules, the FIXED form of each BAD snippet. docs/rules.md is written from them and
its examples run as tests. `HOOKS` lists which function of which rule checks what
(contract.py says what a rule may use).
"""

from . import (
    kvg101_tensor_ids,
    kvg102_duplicate_ids,
    kvg103_bool_ids,
    kvg104_double_free,
    kvg105_tensor_hashing,
    kvg106_tensor_element_id,
    kvg201_no_duplicate_check,
    kvg202_unnormalized_ids,
    kvg203_batched_free,
    kvg204_unchecked_free,
    kvg205_single_free,
)
from .contract import Hooks

RULES = (
    kvg101_tensor_ids,
    kvg102_duplicate_ids,
    kvg103_bool_ids,
    kvg104_double_free,
    kvg105_tensor_hashing,
    kvg106_tensor_element_id,
    kvg201_no_duplicate_check,
    kvg202_unnormalized_ids,
    kvg203_batched_free,
    kvg204_unchecked_free,
    kvg205_single_free,
)

BY_CODE = {rule.CODE: rule for rule in RULES}
CODES = tuple(BY_CODE)

HOOKS = Hooks(
    free_call=(
        kvg101_tensor_ids.check_free_call,
        kvg102_duplicate_ids.check_free_call,
        kvg103_bool_ids.check_free_call,
        kvg106_tensor_element_id.check_free_call,
    ),
    function_end=(kvg104_double_free.check_function,),
    free_method=(
        kvg201_no_duplicate_check.check_free_method,
        kvg202_unnormalized_ids.check_free_method,
        kvg203_batched_free.check_free_method,
        kvg204_unchecked_free.check_free_method,
        kvg205_single_free.check_free_method,
    ),
    call=(kvg105_tensor_hashing.check_call,),
    comparison=(kvg105_tensor_hashing.check_comparison,),
    subscript=(kvg105_tensor_hashing.check_subscript,),
    comprehension=(kvg105_tensor_hashing.check_comprehension,),
)
