"""engine/settings_table.py against every layer that reads settings: ContinuousBatchingConfig, the
server's settings and flags, the CRD's schema, the operator's field list and the docs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cbserve_operator import engine_fields
from engine import settings_render
from engine.cli import build_parser
from engine.config import ContinuousBatchingConfig
from engine.server.settings import ServeSettings, SettingsError, load_settings
from engine.settings_table import (
    SETTINGS,
    camel,
    check_value,
    command_settings,
    crd_fields,
    engine_settings,
    server_settings,
)

REPO = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((REPO / "charts" / "cbserve" / "crds" / "cbdeployments.cbserve.io.yaml").read_text())
ENGINE_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
# `cbserve serve` flags that are no row of the table: the settings file, the API keys (never in a YAML file)
# and where tensor-parallel ranks meet (no variables: the operator renders them as flags)
OWN_FLAGS = {"--config", "--api-key", "--help", "-h", "--nnodes", "--dist-addr", "--dist-port"}
# `cbserve generate`'s own: the dataset and its sampling (its ranks, if any, are all on this host)
GENERATE_FLAGS = {"--input", "--output", "--config", "--max-new-tokens", "--temperature", "--top-p", "--top-k",
                  "--seed", "--stop", "--chunk", "--help", "-h"}


def test_every_config_field_is_a_row_with_the_same_default() -> None:
    fields = {f.name: f for f in dataclasses.fields(ContinuousBatchingConfig)}
    rows = {s.name: s for s in engine_settings()}
    assert set(fields) == set(rows)
    for name, f in fields.items():
        assert rows[name].default == f.default, name
    aliases = {a for s in SETTINGS for a in s.aliases}
    assert set(ContinuousBatchingConfig.field_names()) == set(rows) | aliases


def test_every_server_setting_is_a_serve_settings_field_with_the_same_default() -> None:
    fields = {f.name: f for f in dataclasses.fields(ServeSettings)}
    for s in server_settings():
        assert s.name in fields and fields[s.name].default == s.default, s.name
        assert s.check(s.default) == s.default  # the default passes its own rule
    for s in engine_settings():
        if s.kind in ("int", "float", "bool", "str"):
            assert s.check(s.default) == s.default, s.name


def _flags(command: str) -> dict[str, Any]:
    parser = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    return {opt: action for action in parser._actions for opt in action.option_strings}


@pytest.mark.parametrize("command, own", [("serve", OWN_FLAGS), ("generate", GENERATE_FLAGS)])
def test_each_command_has_a_flag_for_each_of_its_rows_and_no_other_setting_flag(command: str, own: set[str]) -> None:
    flags = _flags(command)
    wanted = {s.cli_flag: s for s in command_settings(command)}
    for flag, s in wanted.items():
        assert flags[flag].dest == s.name, flag
        assert (s.env in flags[flag].help) and (s.default is None or f"default {s.default}" in flags[flag].help)
    negated = {f"--no-{f[2:]}" for f, s in wanted.items() if s.kind == "bool"}
    assert set(flags) - set(wanted) - negated == own
    engine_flags = {s.cli_flag for s in engine_settings() if s.flag} - {"--seed"}  # generate's --seed: per request
    assert engine_flags <= set(flags) and "--tensor-parallel-size" in flags


SAMPLES = {"int": 2, "float": 0.5, "bool": False}
EXPLICIT = {"block_size": 32, "max_body_bytes": 2048, "device": "cuda:1", "attn_implementation": "sdpa",
            "model": "models/mine", "served_model_name": "mine", "host": "127.0.0.1", "port": 8080}
SCALARS = [s for s in SETTINGS if s.kind in ("int", "float", "bool", "str")]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecated fields say so, by design
@pytest.mark.parametrize("row", SCALARS, ids=[s.name for s in SCALARS])
def test_each_setting_arrives_alike_by_yaml_variable_and_flag(row: Any, tmp_path: Path) -> None:
    value = EXPLICIT.get(row.name, row.choices[-1] if row.choices else SAMPLES.get(row.kind))

    def read(cli: dict[str, Any], env: dict[str, str]) -> Any:
        settings = load_settings(cli, environ=env)
        return getattr(settings.engine if row.section == "engine" else settings, row.name)

    config = tmp_path / "settings.yaml"
    config.write_text(yaml.safe_dump({row.name: value}))
    assert read({"config": str(config)}, {}) == value
    assert read({}, {row.env: str(value).lower() if isinstance(value, bool) else str(value)}) == value
    if row.flag:
        flag = [f"--no-{row.cli_flag[2:]}"] if row.kind == "bool" else [row.cli_flag, str(value)]
        assert read(vars(build_parser().parse_args(["serve", *flag])), {}) == value


def test_a_bad_value_is_named_at_every_entry() -> None:
    with pytest.raises(SettingsError, match=r"^max_body_bytes must be an integer >= 1024, got 10$"):
        load_settings({}, environ={"CBSERVE_MAX_BODY_BYTES": "10"})
    with pytest.raises(SettingsError, match=r"^device must be auto, cpu, cuda or cuda:N, got 'tpu'$"):
        load_settings({"device": "tpu"}, environ={})
    with pytest.raises(SettingsError, match=r"^engine setting: max_queue_size must be an integer >= 0, got -1$"):
        load_settings({"max_queue_size": -1}, environ={})
    with pytest.raises(ValueError, match=r"^scheduler_type must be one of fifo, prefill_first, got 'lifo'$"):
        ContinuousBatchingConfig(scheduler_type="lifo")


def test_the_crd_engine_fields_are_the_tables() -> None:
    props = ENGINE_SCHEMA["properties"]
    fields = crd_fields()
    names = [f["crd"] for f in fields] + [old for f in fields for old in f["deprecated"]]
    assert set(props) == set(names) | {"extraArgs"}
    for f in fields:
        for name in (f["crd"], *f["deprecated"]):
            assert props[name] == settings_render.schema_node(f["rule"], props[name]["description"])
            assert "default" not in props[name]  # one default, the server's
    operator_rows = [s for s in SETTINGS if s.operator]
    assert {f["crd"] for f in fields if "part" not in f} == {camel(s.name) for s in operator_rows}
    assert engine_fields.FIELDS == fields  # the operator's generated copy


@pytest.mark.parametrize("value", [-1, 0, 0.5, 1, 2, 16, 24, 256, 2048, True, "fifo", "lifo", "float32", "sdpa",
                                   "bad name", "x" * 65])  # fmt: skip
def test_the_crd_schema_and_the_rule_accept_the_same_values(value: Any) -> None:
    """jsonschema over each generated field agrees with check_value (what the operator and the server apply)."""
    for f in crd_fields():
        node = settings_render.schema_node(f["rule"], "")
        schema_ok = jsonschema.Draft4Validator(node).is_valid(value)
        try:
            check_value(f["rule"], f["crd"], value)
            rule_ok = True
        except ValueError:
            rule_ok = False
        assert schema_ok == rule_ok, (f["crd"], value)


def test_the_docs_table_has_a_row_per_setting_and_nothing_is_stale() -> None:
    text = (REPO / "docs" / "engine.md").read_text()
    block = text.split(settings_render.DOC_BEGIN)[1].split(settings_render.DOC_END)[0]
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `([a-z_]+)`", r).group(1) for r in rows] == [s.name for s in SETTINGS]  # type: ignore[union-attr]
    assert settings_render.stale() == [], "run python -m engine.settings_render --write"
