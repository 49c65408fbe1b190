"""The house: lit_hbp's folders form a stack, each importing only from those below it (docs/design.md,
section 0); the public names import from ``lit_hbp``; modules that moved in 0.2 keep their old import
path, the same module object, with a DeprecationWarning naming the new one."""

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import lit_hbp

PACKAGE = Path(lit_hbp.__file__).parent
# Bottom to top; a room imports only from rooms at its own rank or below.
STACK = [
    {"errors", "model_spec", "moe_spec", "mixer_spec", "report", "demo"},
    {"packing"},
    {"data"},
    {"parallel"},
    {"model"},
    {"cost"},
    {"lightning"},
    {"export", "autoselect"},
    {"simulate"},
    {"callbacks"},
    {"cli"},
]
RANK = {room: i for i, rooms in enumerate(STACK) for room in rooms}


def room_of(module: str) -> str | None:
    """``lit_hbp.model.causal_lm`` -> ``model``; the package itself (``lit_hbp``) -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "lit_hbp" else None


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "lit_hbp":
                out |= {f"lit_hbp.{a.name}" for a in node.names}
            else:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("lit_hbp.")}


def test_every_import_runs_down_the_stack():
    """Each room of lit_hbp/ (a folder or a top-level module) is in the stack, and no import inside the
    package goes from a room to one above it (a room using a higher one is a layer out of place)."""
    rooms = {
        p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.name not in ("__init__.py", "__pycache__")
    }
    rooms = {r for r in rooms if (PACKAGE / r).is_dir() or (PACKAGE / f"{r}.py").is_file()}
    assert rooms == set(RANK), f"rooms not in the stack: {rooms - set(RANK)}; gone: {set(RANK) - rooms}"
    top_level = [p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(top_level) <= 8, top_level
    up = []
    for path in PACKAGE.rglob("*.py"):
        source = room_of(".".join(("lit_hbp", *path.relative_to(PACKAGE).with_suffix("").parts)))
        if source is None or source == "__init__":
            continue
        for target in map(room_of, imports_of(path)):
            if target in RANK and RANK[target] > RANK[source]:
                up.append(f"{path.relative_to(PACKAGE)} -> {target}")
    assert not up, "imports running up the stack:\n" + "\n".join(sorted(up))


def test_a_module_over_600_lines_says_why_in_its_docstring():
    """A library module holds one concept; one over about 600 lines says why it is one module ("on purpose")."""
    long = {}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 600:
            long[str(path.relative_to(PACKAGE))] = "on purpose" in (ast.get_docstring(ast.parse(text)) or "")
    assert all(long.values()), long


def test_the_public_names_import_from_lit_hbp():
    for name in lit_hbp.__all__:
        assert getattr(lit_hbp, name) is not None, name


@pytest.mark.parametrize("old", sorted(lit_hbp.MOVED))
def test_a_moved_module_keeps_its_old_path_with_a_warning(old):
    new = lit_hbp.MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_a_config_naming_an_old_class_path_gets_the_same_class_and_python_m_runs_the_new_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from lit_hbp.strategy import HBPStrategy as old
    from lit_hbp.lightning.strategy import HBPStrategy

    assert old is HBPStrategy
    run = subprocess.run(
        [sys.executable, "-m", "lit_hbp.memory", "--help"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "lit_hbp.cost.memory" in run.stdout, run.stdout + run.stderr


def _room_of_file(filename: str) -> str | None:
    """The room (folder, ``model/attention`` apart from ``model``) of a lit_hbp source file, else None."""
    path = Path(filename)
    if PACKAGE not in path.parents:
        return None
    parts = path.relative_to(PACKAGE).parts
    return "/".join(parts[:-1]) or parts[0].removesuffix(".py")


def _rank_of_room(room: str) -> float:
    return RANK["parallel"] + 0.5 if room == "model/attention" else RANK[room.split("/")[0]]


def walk(step) -> tuple[list[str], list[str]]:
    """The rooms a call of ``step()`` passes through, in the order first entered, and the calls that climb
    from a room to one above it (caller -> callee, each once), traced with ``sys.setprofile``."""
    rooms, climbs = [], []

    def trace(frame, event, arg):
        if event != "call" or (callee := _room_of_file(frame.f_code.co_filename)) is None:
            return
        if callee not in rooms:
            rooms.append(callee)
        caller = frame.f_back
        while caller is not None and _room_of_file(caller.f_code.co_filename) is None:
            caller = caller.f_back  # through torch and transformers, to the lit_hbp code that called them
        if caller is not None and _rank_of_room(callee) > _rank_of_room(_room_of_file(caller.f_code.co_filename)):
            edge = f"{caller.f_code.co_name} -> {frame.f_code.co_name}"
            if edge not in climbs:
                climbs.append(edge)

    sys.setprofile(trace)
    try:
        step()
    finally:
        sys.setprofile(None)
    return rooms, climbs


def test_a_micro_batch_walks_from_packed_loss_to_the_loss_through_few_rooms_downward(tmp_path):
    """issue 56's walk: ``packed_loss`` of a text pack and of an image pack (forward and backward) passes
    through at most 5 rooms and climbs back up a layer at most twice."""
    import torch
    from transformers import AutoModelForImageTextToText, LlamaConfig, LlamaForCausalLM
    from vision_models import build_llava, three_records, trained

    from lit_hbp import pack_samples, packed_loss, prepare_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    text = prepare_model(LlamaForCausalLM(config))
    samples = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in (7, 5, 9)]
    pack = pack_samples(samples).replace(ckpt_layers=1)
    vlm = prepare_model(AutoModelForImageTextToText.from_pretrained(build_llava(tmp_path / "llava")).float())
    records = [trained(r, vlm.config) for r in three_records(tmp_path / "llava")]
    images = pack_samples(records, model=vlm)
    assert images.mm is not None  # the image path: the pack carries pixels the call encodes
    for model, batch in ((text, pack), (vlm, images)):
        packed_loss(model, batch, "sum").loss.backward()  # the first call decides and logs the backend
        rooms, climbs = walk(lambda m=model, b=batch: packed_loss(m, b, "sum").loss.backward())
        assert rooms[0] == "model" and len(rooms) <= 5, rooms
        assert len(climbs) <= 2, climbs
