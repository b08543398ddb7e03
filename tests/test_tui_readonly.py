"""Widgets read the state and never write it: the app alone folds updates into `RunState` (and the
source, the rank follower and the key handlers it calls). A panel that wrote the state would make what
one panel shows depend on whether another panel drew first."""

from __future__ import annotations

import ast
import pickle
import time
from pathlib import Path

from dflash_tui import synthetic
from dflash_tui.app import DFlashTop
from dflash_tui.sources import MemorySource
from dflash_tui.state import RunState

WIDGETS = Path(__file__).resolve().parents[1] / "dflash_tui" / "widgets"
#: calls that change a container, and every RunState method that writes
MUTATORS = {"append", "appendleft", "extend", "insert", "pop", "popleft", "popitem", "clear", "update", "add",
            "remove", "discard", "setdefault", "sort", "reverse"} | {
    name for name in vars(RunState) if name.startswith(("apply", "forget", "reset", "note", "_log", "_ring"))}


def _shared(node: ast.expr, roots: set[str]) -> bool:
    """Whether `node` is the state or reaches into it or the app: `state`, `state.x[...]`, `self._state.x`,
    `self.app.x` (but not `self._state` itself: that is the widget's own reference)."""
    chain = []
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        if isinstance(node, ast.Attribute):
            chain.append(node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    chain.reverse()
    if not isinstance(node, ast.Name):
        return False
    return node.id in roots or (node.id == "self" and len(chain) > 1 and chain[0] in ("_state", "app"))


def writes_of_shared_state(source: str) -> list[int]:
    """Line numbers where widget code assigns into, deletes from or calls a mutator on the state or app."""
    tree = ast.parse(source)
    roots = {"state"} | {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg) and a.annotation is not None
                         and ast.unparse(a.annotation) == "RunState"}
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        call = False
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets, call = [node.func.value], True
        flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        # a bare name as an assignment's target only rebinds a local; as a mutator's receiver it is the object
        if any((call or isinstance(t, ast.Attribute | ast.Subscript)) and _shared(t, roots) for t in flat):
            lines.append(node.lineno)
    return lines


def test_the_write_check_sees_a_write() -> None:
    """The checker itself: each way of writing the state is caught, reading is not."""
    for bad in ("state.hello = None", "state.events.popleft()", "self._state.known['w'] = {}",
                "self.app.job = 'x'", "def f(s: RunState):\n    s.note('info', 'x')", "state.loss.values[0] += 1",
                "del state.known['w']", "state.cluster, x = None, 1"):
        assert writes_of_shared_state(bad), bad
    for fine in ("x = state.hello", "t.append(state.loss)", "self.rows = list(state.known)",
                 "self.parent.border_title = 't'", "n = len(state.events)",
                 "self._state = state", "state = other"):
        assert not writes_of_shared_state(fine), fine


def test_no_widget_writes_the_state_or_the_app() -> None:
    found = {p.name: writes_of_shared_state(p.read_text()) for p in sorted(WIDGETS.glob("*.py"))}
    assert not {name: lines for name, lines in found.items() if lines}


async def test_drawing_every_panel_leaves_the_state_unchanged() -> None:
    """Every panel (each zoomed, too: some draw more rows then) redraws from a state holding an event
    the log has not shown yet; the state is the same, byte for byte, afterwards, and the log shows it."""
    frames = synthetic.frames(30, workers=4, gpus=2, world_size=2)
    app = DFlashTop(source=MemorySource(frames, detail="fixed frames"), pyspy_exe="py-spy")
    async with app.run_test(size=(160, 50)) as pilot:
        deadline = time.monotonic() + 10
        while app.state.snapshot is None:
            assert time.monotonic() < deadline, "the fixed frames were never applied"
            await pilot.pause(0.05)
        await pilot.pause()
        app.state.note("info", "not drawn yet")
        before = pickle.dumps(app.state)
        for index in range(6):
            app.action_panel(index)
            await pilot.pause()
            app.action_panel(index)
        for panel in app.panels:
            panel.refresh_from(app.state)
        await pilot.pause()
        assert pickle.dumps(app.state) == before
        log = app.query_one("#events")
        assert any("not drawn yet" in line.text for line in log.lines)
        assert sum("not drawn yet" in line.text for line in log.lines) == 1  # caught up once, not per redraw
