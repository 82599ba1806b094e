"""The shadow-module loader: GPU-targeted modules import as their CPU mocks inside `shadow.active(...)`.

    import shadow
    with shadow.active(profile):      # import hook + torch.cuda shim, undone on exit
        run_training_script()

The registry (real module -> mock module) is data: mocks/shadow_registry.toml. `shadow.contract`
checks that each mock exposes its real module's public API.
"""

from shadow.loader import active, current, is_active
from shadow.registry import Registry, load_registry

__all__ = ["Registry", "active", "current", "is_active", "load_registry"]
