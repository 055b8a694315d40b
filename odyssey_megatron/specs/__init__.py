"""Shipped hardware and model specifications, used to build analytic profiles."""

from odyssey_megatron.specs.devices import DEVICE_SPECS, DeviceSpec, device_spec
from odyssey_megatron.specs.models import MODEL_SPECS, model_spec

__all__ = ["DEVICE_SPECS", "DeviceSpec", "device_spec", "MODEL_SPECS", "model_spec"]
