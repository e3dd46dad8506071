"""The AsyncAPI document of the tenant event interface: committed copy current, complete, self-contained and valid.

The document is generated from the code (`harmonaize asyncapi`), so these tests check the generator and the committed
copy together: the copy is exactly what the code generates now (a model changed without regenerating fails here, and
`--check` fails CI the same way); every registered event type has its channel, message, schema and example; every
`$ref` resolves inside the document; every example validates against the schemas; and the AsyncAPI project's own
parser accepts the document (tools/asyncapi-validate; skipped without node or its install, except under CI=1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import jsonschema_rs
import pytest
import typer
from typer.testing import CliRunner

from harmonaize.asyncapi import (
    ASYNCAPI_VERSION,
    DOCUMENT_FILE,
    EXAMPLE_DATA,
    SCHEMAS_DIR,
    build_document,
    build_schema_files,
    generated_files,
    render_json,
    schema_file_name,
)
from harmonaize.events import DEFAULT_REGISTRY, EventKind, Failure, parse_event
from harmonaize.events.registry import EventRegistry
from harmonaize_cli.asyncapi_command import asyncapi_command, write_files

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "asyncapi"
VALIDATOR = ROOT / "tools" / "asyncapi-validate"
FAILURE_SCHEMA = f"{SCHEMAS_DIR}/{schema_file_name(Failure)}"


class _FailureWithNote(Failure):
    """A changed model: the same type as `Failure`, with one more field (what an unregenerated edit looks like)."""

    KIND: ClassVar[EventKind] = EventKind.FAILURE
    VERSION: ClassVar[int] = 1

    note: str = ""


def _run(*args: str) -> tuple[int, str]:
    app = typer.Typer(add_completion=False)
    app.command()(asyncapi_command)
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "400", "NO_COLOR": "1"})
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return build_document()


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    return generated_files()


# (a) the committed copy is what the code generates --------------------------------------------------------------


def test_committed_document_is_what_the_code_generates(files: dict[str, str]) -> None:
    code, output = _run("--check", "--out", str(COMMITTED))
    assert code == 0, f"docs/asyncapi is out of date; run `harmonaize asyncapi` and commit the result.\n{output}"
    for name, text in files.items():
        assert (COMMITTED / name).read_bytes() == text.encode(), f"{name}: run `harmonaize asyncapi`"


def test_generation_is_deterministic(files: dict[str, str]) -> None:
    assert generated_files() == files
    document = json.loads(files[DOCUMENT_FILE])
    assert render_json(document) == files[DOCUMENT_FILE], "the text is canonical (sorted keys, fixed indent)"


# (b) --check notices a changed model, an edited file, a missing or a stale one ------------------------------------


def test_check_names_the_files_a_changed_model_would_change(tmp_path: Path) -> None:
    changed = EventRegistry([model for model in DEFAULT_REGISTRY if model is not Failure] + [_FailureWithNote])
    changed_files = generated_files(changed)
    assert "note" in json.loads(changed_files[FAILURE_SCHEMA])["properties"]
    write_files(tmp_path, changed_files)

    code, output = _run("--check", "--out", str(tmp_path))

    assert code == 1, output
    assert DOCUMENT_FILE in output and FAILURE_SCHEMA in output and "run `harmonaize asyncapi" in output
    assert f"{SCHEMAS_DIR}/io.harmonaize.carbon.v1.json" not in output, "only the files that differ are named"


def test_check_names_edited_missing_and_stale_files_and_writing_repairs_them(tmp_path: Path) -> None:
    code, output = _run("--out", str(tmp_path))
    assert code == 0, output
    assert _run("--check", "--out", str(tmp_path))[0] == 0

    edited = tmp_path / f"{SCHEMAS_DIR}/io.harmonaize.topology.v1.json"
    edited.write_text(edited.read_text().replace('"Topology"', '"Topology2"'))
    (tmp_path / FAILURE_SCHEMA).unlink()
    (tmp_path / SCHEMAS_DIR / "io.harmonaize.retired.v1.json").write_text("{}\n")

    code, output = _run("--check", "--out", str(tmp_path))
    assert code == 1
    assert len(output.strip().splitlines()) == 1, output
    for name in ("io.harmonaize.topology.v1.json", "io.harmonaize.failure.v1.json", "io.harmonaize.retired.v1.json"):
        assert f"{SCHEMAS_DIR}/{name}" in output

    assert _run("--out", str(tmp_path))[0] == 0
    assert _run("--check", "--out", str(tmp_path))[0] == 0
    assert not (tmp_path / SCHEMAS_DIR / "io.harmonaize.retired.v1.json").exists()


def test_an_event_type_without_a_valid_example_is_refused() -> None:
    with pytest.raises(ValueError, match="no example for io.harmonaize.failure.v1"):
        build_document(examples={t: e for t, e in EXAMPLE_DATA.items() if t != "io.harmonaize.failure.v1"})
    source, data = EXAMPLE_DATA["io.harmonaize.failure.v1"]
    with pytest.raises(ValueError, match="confidence"):
        build_document(examples={**EXAMPLE_DATA, "io.harmonaize.failure.v1": (source, {**data, "confidence": 2})})


# (c) the AsyncAPI project's parser accepts it --------------------------------------------------------------------


def _node_and_parser() -> str:
    node = shutil.which("node")
    missing = None
    if node is None:
        missing = "node is not on PATH"
    elif not (VALIDATOR / "node_modules" / "@asyncapi" / "parser").is_dir():
        missing = "tools/asyncapi-validate is not installed (npm ci --prefix tools/asyncapi-validate)"
    if missing is not None or node is None:
        message = f"cannot run the official AsyncAPI parser: {missing}"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must install it")
        pytest.skip(message)
    return node


def test_the_official_parser_accepts_the_document_and_refuses_a_broken_one(
    tmp_path: Path, document: dict[str, Any]
) -> None:
    node = _node_and_parser()
    good = tmp_path / "good.json"
    good.write_text(render_json(document))
    broken = json.loads(render_json(document))
    broken["operations"]["receiveFailure"]["messages"] = [{"$ref": "#/channels/topology/messages/topology.v1"}]
    bad = tmp_path / "bad.json"
    bad.write_text(render_json(broken))

    completed = subprocess.run(
        [node, str(VALIDATOR / "validate.mjs"), str(good), str(bad)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )

    lines = completed.stdout.splitlines()
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert f"good.json: valid AsyncAPI {ASYNCAPI_VERSION} (0 warnings)" in lines, completed.stdout
    assert not [line for line in lines if line.startswith("good.json:") and "valid AsyncAPI" not in line], lines
    assert any(line.startswith("bad.json: error asyncapi3-operation-messages-from-referred-channel") for line in lines)
    assert any(line.startswith("bad.json: INVALID") for line in lines)


# (d) complete, self-contained, examples valid --------------------------------------------------------------------


def test_every_event_type_has_a_channel_operation_message_schema_and_example(
    document: dict[str, Any], files: dict[str, str]
) -> None:
    assert document["asyncapi"] == ASYNCAPI_VERSION
    messages = {message["name"]: key for key, message in document["components"]["messages"].items()}
    assert sorted(messages) == sorted(DEFAULT_REGISTRY.types)
    for model in DEFAULT_REGISTRY:
        key = messages[model.event_type()]
        channel = document["channels"][model.KIND.value]
        assert channel["address"] == f"hz.t.{{tenant}}.events.{model.KIND.value}.{{job}}"
        assert set(channel["parameters"]) == {"tenant", "job"}
        assert channel["messages"][key] == {"$ref": f"#/components/messages/{key}"}
        channel_ref = f"#/channels/{model.KIND}"
        operations = [op for op in document["operations"].values() if op["channel"]["$ref"] == channel_ref]
        assert len(operations) == 1 and operations[0]["action"] == "receive"
        assert {"$ref": f"#/channels/{model.KIND}/messages/{key}"} in operations[0]["messages"]
        message = document["components"]["messages"][key]
        assert message["contentType"] == "application/cloudevents+json" and len(message["examples"]) == 1
        envelope = _resolve(document, message["payload"]["$ref"])
        assert envelope["properties"]["type"]["const"] == model.event_type()
        assert _resolve(document, envelope["properties"]["data"]["$ref"])["title"] == model.__name__
        assert f"{SCHEMAS_DIR}/{schema_file_name(model)}" in files


def test_every_ref_resolves_inside_its_document(document: dict[str, Any]) -> None:
    refs = list(_refs(document))
    assert len(refs) > 50
    for ref in refs:
        assert ref.startswith("#/"), f"{ref} points outside the document"
        _resolve(document, ref)
    for name, schema in build_schema_files().items():
        for ref in _refs(schema):
            assert ref.startswith("#/$defs/"), f"{name}: {ref}"
            _resolve(schema, ref)


def test_every_example_validates_against_its_schemas_and_parses(document: dict[str, Any]) -> None:
    components = document["components"]
    standalone = build_schema_files()
    for model in DEFAULT_REGISTRY:
        message = next(m for m in components["messages"].values() if m["name"] == model.event_type())
        example = message["examples"][0]
        payload_schema = {"$ref": message["payload"]["$ref"], "components": components}
        headers_schema = {"$ref": message["headers"]["$ref"], "components": components}
        _assert_valid(jsonschema_rs.Draft7Validator(payload_schema, validate_formats=True, offline=True),
                      example["payload"], f"{model.event_type()} example payload")
        _assert_valid(jsonschema_rs.Draft7Validator(headers_schema, offline=True), example["headers"],
                      f"{model.event_type()} example headers")
        _assert_valid(jsonschema_rs.validator_for(standalone[schema_file_name(model)], validate_formats=True,
                                                  offline=True),
                      example["payload"]["data"], f"{schema_file_name(model)} (the example's data)")
        event = parse_event(json.dumps(example["payload"]))
        assert type(event.data) is model and example["headers"]["Nats-Msg-Id"] == event.id
        assert event.to_json_dict() == example["payload"]


def test_the_schemas_refuse_what_the_models_refuse(document: dict[str, Any]) -> None:
    """The examples passing is only meaningful if the schemas have teeth: a wrong type, a bad job id, a bad host."""
    components = document["components"]
    message = components["messages"]["failure.v1"]
    validator = jsonschema_rs.Draft7Validator({"$ref": message["payload"]["$ref"], "components": components},
                                              validate_formats=True, offline=True)
    example = message["examples"][0]["payload"]
    assert validator.is_valid(example)
    for change in ({"type": "io.harmonaize.carbon.v1"}, {"subject": "Train.7"}, {"data": {**example["data"],
                   "host": "gpu-node-17"}}, {"Bad-Name": "x"}, {"specversion": "0.3"}):
        assert not validator.is_valid({**example, **change}), change
    assert not validator.is_valid({k: v for k, v in example.items() if k != "id"})


def _assert_valid(validator: jsonschema_rs.Validator, instance: Any, what: str) -> None:
    errors = [f"/{'/'.join(map(str, e.instance_path))}: {e.message}" for e in validator.iter_errors(instance)]
    assert not errors, f"{what} does not validate:\n" + "\n".join(errors)


def _refs(value: Any) -> Iterator[str]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if key == "$ref" and isinstance(item, str):
                yield item
            else:
                yield from _refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for token in ref.removeprefix("#/").split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, Mapping) and token in node, f"{ref} does not resolve (at {token!r})"
        node = node[token]
    return node
