"""Test support shipped with gemmaserve: a deterministic reference backend, the backend conformance
kit and KV state machines. Needs the ``testing`` extra (pytest, hypothesis) for the kit; names are
imported lazily, so ``gemmaserve.testing.reference_backend`` works without pytest installed."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if "pytest" in sys.modules:  # under pytest: show diffs for the kit's plain asserts
    sys.modules["pytest"].register_assert_rewrite(
        "gemmaserve.testing.backend_contract", "gemmaserve.testing.row_driver", "gemmaserve.testing.kv_machines"
    )

if TYPE_CHECKING:
    from gemmaserve.testing.backend_contract import BackendContractTests, run_row_ops_property
    from gemmaserve.testing.kv_machines import (
        create_block_manager_machine,
        create_cache_manager_machine,
        create_radix_machine,
    )
    from gemmaserve.testing.reference_backend import ReferenceBackend, create_reference_backend
    from gemmaserve.testing.row_driver import RowPlan, drive_rows, solo_greedy

__all__ = [
    "BackendContractTests",
    "run_row_ops_property",
    "ReferenceBackend",
    "create_reference_backend",
    "RowPlan",
    "drive_rows",
    "solo_greedy",
    "create_block_manager_machine",
    "create_radix_machine",
    "create_cache_manager_machine",
]

_HOMES = {
    "BackendContractTests": "backend_contract",
    "run_row_ops_property": "backend_contract",
    "ReferenceBackend": "reference_backend",
    "create_reference_backend": "reference_backend",
    "RowPlan": "row_driver",
    "drive_rows": "row_driver",
    "solo_greedy": "row_driver",
    "create_block_manager_machine": "kv_machines",
    "create_radix_machine": "kv_machines",
    "create_cache_manager_machine": "kv_machines",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'gemmaserve.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gemmaserve.testing.{home}"), name)
