"""engine/sampling.py: which path serves which parameter, and that every path samples right."""
from __future__ import annotations

import dataclasses

import pytest

from pflash_plugin.llama import Dry, DynaTemp, Xtc
from pflash_plugin.engine.request import SamplingParams
from pflash_plugin.engine.sampling import (BATCH_FIELDS, CHAIN_FIELDS, DEVICE_FIELDS, NEUTRAL, PATHS,
                                           SCHEDULER_FIELDS, asked_fields, choose_path)

SERVED = {name: served for name, served in PATHS}


def _changed(field: dataclasses.Field) -> object:
    """A value other than the field's default (and its neutral value), by the default's type."""
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
    special = {"seed": 5, "grammar": 'root ::= "a"', "logprobs": 2, "logit_bias": {3: 1.5}, "stop": ["x"],
               "mirostat": 2, "constraint": '{"grammars": []}', "dry": Dry(0.8), "xtc": Xtc(0.5), "top_n_sigma": 1.0,
               "dynatemp": DynaTemp(0.5), "stop_token_ids": frozenset({7}),
               "kept_stops": frozenset({"x"})}
    if field.name in special:
        return special[field.name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1 if default != 0 else 0.5
    raise AssertionError(f"{field.name}: no changed value for a default of type {type(default).__name__}")


def test_every_field_of_sampling_params_is_named_by_a_path_list():
    """A new parameter must be placed: one no list names would be silently ignored by the path that
    serves its request (as the batch path once ignored every parameter a deny-list forgot)."""
    for field in dataclasses.fields(SamplingParams):
        assert field.name in SCHEDULER_FIELDS or field.name in CHAIN_FIELDS, f"{field.name}: no path list names it"
        assert not (field.name in SCHEDULER_FIELDS and field.name in CHAIN_FIELDS), field.name
    assert DEVICE_FIELDS <= BATCH_FIELDS <= CHAIN_FIELDS  # each path falls back to one that serves more
    assert set(NEUTRAL) <= CHAIN_FIELDS


@pytest.mark.parametrize("field", [f for f in dataclasses.fields(SamplingParams) if f.name not in SCHEDULER_FIELDS],
                         ids=lambda f: f.name)
def test_a_request_that_sets_a_field_takes_a_path_whose_list_names_it(field):
    params = dataclasses.replace(SamplingParams(), **{field.name: _changed(field)})
    assert field.name in asked_fields(params)
    for device in (False, True):
        path = choose_path(params, device)
        assert field.name in SERVED[path] and (device or path != "device")


def test_the_defaults_and_their_paths():
    assert choose_path(SamplingParams(), device=True) == "device"
    assert choose_path(SamplingParams(), device=False) == "batch"
    assert choose_path(SamplingParams(logprobs=0), device=True) == "batch"  # no log-probabilities on the device
    for host_only in ({"grammar": 'root ::= "a"'}, {"typical_p": 0.5}, {"mirostat": 1}):
        assert choose_path(SamplingParams(**host_only), device=True) == "chain"


def test_a_field_no_list_names_sends_its_request_nowhere():
    @dataclasses.dataclass
    class Extended(SamplingParams):
        xtc_probability: float = 0.5  # a parameter added without naming a path

    with pytest.raises(ValueError, match="xtc_probability"):
        choose_path(Extended(), device=False)


def test_backend_sampling_settings(tiny_model):
    """auto leaves a CPU model's rows on the host; on and off mean every row the backend serves, and none."""
    from pflash_plugin.engine.sampling import device_sampling
    from pflash_plugin.llama import Model

    model = Model(tiny_model)
    assert [device_sampling(s, model) for s in ("auto", "on", "off")] == ["none", "all", "none"]
    with pytest.raises(ValueError):
        device_sampling("yes", model)


def test_auto_samples_on_a_gpu_host_only_without_the_native_sampler(tiny_model, monkeypatch):
    """auto with the output layer on a GPU: the device chains where numpy would sample the rows, the
    host where the native sampler does (it beat the device chains on an H200: docs/sampling.md)."""
    from pflash_plugin.engine import sampling
    from pflash_plugin.llama import Model, model as model_module

    model = Model(tiny_model)
    monkeypatch.setattr(model_module, "gpu_count", lambda: 1)
    monkeypatch.setattr(model, "n_gpu_layers", -1)
    monkeypatch.setattr(sampling.native, "load", lambda: object())
    assert sampling.device_sampling("auto", model) == "none"
    monkeypatch.setattr(sampling.native, "load", lambda: None)
    assert sampling.device_sampling("auto", model) == "sampled"
