"""Stateful (hypothesis) tests of the KV bookkeeping, through the shipped conformance machines."""

from __future__ import annotations

from hypothesis import settings

from gemmaserve.kv import BlockManager, CacheManager, RadixPrefixIndex
from gemmaserve.testing.kv_machines import (
    create_block_manager_machine,
    create_cache_manager_machine,
    create_radix_machine,
)

_SETTINGS = settings(max_examples=200, stateful_step_count=40, deadline=None)

TestBlockManagerMachine = create_block_manager_machine(BlockManager).TestCase
TestBlockManagerMachine.settings = _SETTINGS

TestRadixMachine = create_radix_machine(RadixPrefixIndex).TestCase
TestRadixMachine.settings = _SETTINGS

# Tuple values, as a backend with several KV pools would store: the index must treat them opaquely.
TestRadixMachineTupleValues = create_radix_machine(make_value=lambda n: (n, -n)).TestCase
TestRadixMachineTupleValues.settings = settings(_SETTINGS, max_examples=50)

TestCacheManagerMachine = create_cache_manager_machine(CacheManager).TestCase
TestCacheManagerMachine.settings = settings(_SETTINGS, stateful_step_count=50)
