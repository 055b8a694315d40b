"""Shipped hardware, model and corpus specifications."""

from odyssey_megatron.specs.corpora import CORPUS_SPECS, PYTHON_DOCSTRINGS
from odyssey_megatron.specs.devices import DEVICE_SPECS, DeviceSpec, device_spec
from odyssey_megatron.specs.models import MODEL_SPECS, model_spec

__all__ = ["CORPUS_SPECS", "PYTHON_DOCSTRINGS", "DEVICE_SPECS", "DeviceSpec", "device_spec", "MODEL_SPECS", "model_spec"]
