"""Module introspection shared by every platform: parameters, buffers, the model state dict."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def parameters_dict(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every parameter of the module and its children, by dotted name (shared ones once)."""
    return dict(module.named_parameters())


def buffers_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of the module and its children, persistent or not, by dotted name."""
    return dict(module.named_buffers())


def get_model_state_dict(module: torch.nn.Module) -> dict[str, object]:
    """The module's state dict (parameters, persistent buffers, and any module's extra
    state: whatever its get_extra_state() returns, hence ``object``)."""
    return dict(module.state_dict())


class ModuleIntrospection:
    """The introspection part of the platform protocol; it does not depend on the device."""

    def parameters_dict(self, module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        return parameters_dict(module)

    def buffers_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return buffers_dict(module)

    def get_model_state_dict(self, module: torch.nn.Module) -> dict[str, object]:
        return get_model_state_dict(module)
