"""The Serve page's launch settings: which engine (or hybrid mode), model, context, parallel sequences and engine
flags, with the Start, Stop, Switch, Export and Prepare vLLM buttons, and the plan the form asks for. The page wires
the buttons to the session; this widget only holds and reads the form.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QSpinBox, QWidget

from desktop.core.common.defaults import DEFAULT_CTX_PER_REQUEST, DEFAULT_SLOTS
from desktop.core.common.errors import SwitchyardError
from desktop.ui.engine_session import engine_choices
from desktop.ui.model_picker import ModelPicker

HYBRID = "auto"  # the engine list's hybrid entry (`serve --engine auto`)


def form_plan(engine: str, model: str, ctx: int, parallel: int, flags: str = "") -> Any:
    """What the form asks for, as a plan not yet checked (the session's endpoint checks it before it starts).
    `flags`: the engine's own flags as typed (engines.engine_args counts, refuses or passes each through)."""
    import shlex

    from desktop.core.engines import get_adapter
    from desktop.core.engines.engine_args import plan_fields_from_args
    from desktop.core.planning.planner import ask

    asked: dict[str, Any] = {"ctx_per_request": ctx, "slots": parallel}
    if flags.strip():
        try:
            words = shlex.split(flags)
        except ValueError as exc:
            raise SwitchyardError(f"the engine flags do not parse: {exc}", "check the quotes") from None
        asked.update(plan_fields_from_args(get_adapter(engine).name, words))
    return ask(engine, model, asked)


def plan_for_form(engine: str, model: str, ctx: int, parallel: int, flags: str = "") -> Any:
    """The checked LaunchPlan the Start button would launch on this machine (installs and starts nothing)."""
    from desktop.core.machine.hardware import detect
    from desktop.core.planning.planner import replan

    return replan(form_plan(engine, model, ctx, parallel, flags), detect()).plan


def prepared_text(done: Any) -> str:
    """"Prepare vLLM" done (serving.prepare's answer), in words: the compile cache and how long that start took."""
    cold = done.cold_start
    return (f"vLLM prepared on {done.model}: compile cache {done.compile_cache or 'not reported'} "
            f"({'was already warm' if done.was_warm else 'filled now'}); that start took "
            f"{(cold.get('t3_first_request_s') or 0):.1f} s. The next start of this plan loads compiled graphs.")


class LaunchForm(QWidget):
    """One row: the launch settings and the buttons that act on them."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.engine_box = QComboBox()
        for key, label in engine_choices():  # the adapter registry: a new engine shows up here by itself
            self.engine_box.addItem(label, key)
        self.engine_box.addItem("Hybrid (auto)", HYBRID)
        self.engine_box.setItemData(self.engine_box.count() - 1, "llama.cpp serves at once; vLLM is brought in "
                                    "when sustained load passes this machine's crossover, and retired when idle",
                                    Qt.ItemDataRole.ToolTipRole)
        self.engine_box.setAccessibleName("Engine")
        self.model_edit = ModelPicker()  # the library's models with their fit; a typed path still works
        self.engine_box.currentIndexChanged.connect(lambda _index: self.model_edit.refresh(self.engine_choice()))
        self.ctx_spin = QSpinBox()
        self.ctx_spin.setRange(256, 1_048_576)
        self.ctx_spin.setSingleStep(1024)
        self.ctx_spin.setValue(DEFAULT_CTX_PER_REQUEST)
        self.ctx_spin.setAccessibleName("Context length")
        self.parallel_spin = QSpinBox()
        self.parallel_spin.setRange(1, 1024)
        self.parallel_spin.setValue(DEFAULT_SLOTS)
        self.parallel_spin.setAccessibleName("Parallel sequences")
        self.flags_edit = QLineEdit()
        self.flags_edit.setAccessibleName("Engine flags")
        self.flags_edit.setPlaceholderText("engine flags")
        self.flags_edit.setToolTip("The engine's own flags, as after `switchyard serve ... --`: the fit counts "
                                   "--n-cpu-moe, --cpu-moe, -ctk/-ctv (llama.cpp) and --cpu-offload-gb (vLLM); "
                                   "flags the plan owns are refused; the rest pass through unaccounted")
        # the one reasoning setting, for requests that do not set their own (placed by the page beside the model id:
        # it acts on requests, and this row is full)
        self.reasoning_box = QComboBox()
        for effort in ("auto", "off", "low", "medium", "high"):
            self.reasoning_box.addItem(f"Thinking: {effort}", effort)
        self.reasoning_box.setAccessibleName("Thinking")
        self.reasoning_box.setToolTip("How much a reasoning model thinks when a request does not say (OpenAI's "
                                      "reasoning_effort, Ollama's think): each engine gets its own fields; off "
                                      "answers sooner. auto: the model's and engine's default. Applies at once")
        self.start_button = QPushButton("&Start")
        self.stop_button = QPushButton("S&top")
        self.switch_button = QPushButton("S&witch engine")
        self.export_button = QPushButton("E&xport…")
        self.export_button.setToolTip("This launch plan as a shell command, docker run, Compose, Kubernetes, Ray "
                                      "or Helm")
        self.prepare_button = QPushButton("&Prepare vLLM")
        self.prepare_button.setToolTip("Start vLLM once on this model and plan and stop it, so its compile cache "
                                       "is warm and the real first start (or a switch) is much shorter")
        controls = QHBoxLayout(self)
        controls.setContentsMargins(0, 0, 0, 0)
        for caption, widget in (("&Engine:", self.engine_box), ("&Model:", self.model_edit),
                                ("&Context:", self.ctx_spin), ("&Parallel:", self.parallel_spin),
                                ("F&lags:", self.flags_edit)):
            buddy = QLabel(caption)
            buddy.setBuddy(widget)
            controls.addWidget(buddy)
            controls.addWidget(widget, 2 if widget is self.model_edit else 0)
        controls.addWidget(self.start_button)
        controls.addWidget(self.stop_button)
        controls.addWidget(self.switch_button)
        controls.addWidget(self.export_button)
        controls.addWidget(self.prepare_button)

    def model(self) -> str:
        return self.model_edit.text().strip() or "demo"

    def engine_choice(self) -> str:
        """The engine box's entry as the picker filters by it: an engine's name, or "auto" (hybrid)."""
        return str(self.engine_box.currentData())

    def engine(self) -> str:
        """The engine the form names (hybrid mode starts on llama.cpp: its plan is the one to export)."""
        engine = str(self.engine_box.currentData())
        return "llama.cpp" if engine == HYBRID else engine

    def hybrid(self) -> bool:
        return bool(self.engine_box.currentData() == HYBRID)

    def asks(self) -> tuple[str, str, int, int, str]:
        """(engine, model, context, parallel, flags) as form_plan and plan_for_form take them."""
        return (str(self.engine_box.currentData()), self.model(), self.ctx_spin.value(), self.parallel_spin.value(),
                self.flags_edit.text())

    def show_plan(self, plan: Any) -> str:
        """Fill the form from `plan` (a LaunchPlan); its model, as the form shows it."""
        index = self.engine_box.findData(plan.engine)
        if index >= 0:
            self.engine_box.setCurrentIndex(index)
        model = plan.model or str(plan.model_path)
        self.model_edit.setText(model)
        self.ctx_spin.setValue(plan.ctx_per_request)
        self.parallel_spin.setValue(plan.slots)
        return str(model)

    def show_buttons(self, running: bool, busy: bool, hybrid: bool, other_engine: str) -> None:
        """Start while nothing runs, Stop while something runs or starts, Switch (to `other_engine`) while one
        engine serves and hybrid mode is off (its loop switches: a manual switch would fight it)."""
        self.start_button.setEnabled(not running and not busy)
        self.stop_button.setEnabled(running or busy)
        self.switch_button.setEnabled(running and not busy and not hybrid)
        self.switch_button.setText(f"S&witch to {other_engine}")
        if hybrid:
            self.switch_button.setToolTip("Hybrid mode switches by itself (see its decision above); stop it and "
                                          "start one engine to switch by hand")
