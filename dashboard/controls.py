"""The sidebar: Start / Stop / Follow, and the settings of the next run, each box with what is
wrong with its value right under it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import panel as pn
import param

from dashboard.live import LiveRun
from dashboard.settings import GENERAL, RunSettings, describe_config


# Two to a row: the schedule of K and its frames in the row under K.
SETTINGS_ORDER = ("backend", "ranks", "average_every", "average_schedule", "post_local_frames",
                  "averaging", "momentum", "reduce", "payload", "payload_bits", "lr", "final_lr",
                  "schedule", "optimizer", "pretrain", "epochs", "minibatch", "context",
                  "hidden_layers", "hidden_dim")
_ERROR_STYLE = {"color": "#b00020", "font-size": "0.85em", "line-height": "1.25"}
# Markdown's paragraph margins would leave a blank line under every message.
_ERROR_SHEET = ["p { margin: 0; }"]
_WARNING_COLOR = "#8a5300"  # amber: the run may start, but read this first


class SettingsPanel(pn.viewable.Viewer):
    """The controls of the next run (`RunSettings`)."""

    def __init__(self, settings: RunSettings, **params: Any) -> None:
        super().__init__(**params)
        self.settings = settings

    def __panel__(self) -> pn.Column:
        return settings_panel(self.settings)


def _number_text(value: Any) -> str:
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def number_box(settings: RunSettings, name: str, placeholder: str = "") -> pn.widgets.TextInput:
    """A text box for number setting `name`: what is typed is judged as typed
    (`RunSettings.type_text`), so "0,01" or "abc" are refused beside it instead of the
    browser's number box quietly making them 1 or nothing; a preset's value shows in it."""
    box = pn.widgets.TextInput(label=settings.label(name), placeholder=placeholder,
                               value=_number_text(getattr(settings, name)))
    pn.bind(lambda text: settings.type_text(name, text), box.param.value_input, watch=True)

    def follow(value: Any) -> None:
        # Only a value the box's text does not already say: typing "0." must stay "0.".
        try:
            shown = float(box.value_input or box.value) if (box.value_input or box.value) else None
        except ValueError:
            shown = object()
        if shown != value and name not in settings.typed:
            box.param.update(value=_number_text(value), value_input=_number_text(value))

    pn.bind(follow, settings.param[name], watch=True)
    return box


def _widget(settings: RunSettings, name: str) -> pn.widgets.Widget:
    parameter = settings.param[name]
    if isinstance(parameter, param.Selector):
        # Widget.from_param links both ways: a preset that sets a parameter shows in its box.
        return pn.widgets.Select.from_param(parameter)
    if isinstance(parameter, param.Number):
        return number_box(settings, name, "0.01 × lr" if name == "final_lr" else "")
    box = pn.widgets.TextInput.from_param(parameter)
    # Checked as typed: a path is judged on each keystroke, not when the box loses focus.
    pn.bind(lambda text: setattr(settings, name, text), box.param.value_input, watch=True)
    return box


def _message_pane(name: str) -> pn.pane.Markdown:
    return pn.pane.Markdown("", visible=False, sizing_mode="stretch_width", margin=(0, 8, 4, 8),
                            styles=_ERROR_STYLE, stylesheets=_ERROR_SHEET,
                            css_classes=["labavg-error"], name=f"error-{name}")


def settings_panel(settings: RunSettings) -> pn.Column:
    """The controls, two to a row (so they fit at 1366x768), typed boxes instead of sliders;
    under each, what is wrong with its value (RunSettings.errors, red) or what to know about
    it (RunSettings.warnings, amber), shown only when there is something to say."""
    names = ("preset", *SETTINGS_ORDER, "data", "runs_dir")
    widgets = {name: _widget(settings, name) for name in names}
    messages = {name: _message_pane(name) for name in names}

    def show(*_: Any) -> None:
        for name, pane in messages.items():
            error, warning = settings.errors.get(name, ""), settings.warnings.get(name, "")
            text = error or warning
            pane.param.update(object=text.replace("*", "\\*").replace("_", "\\_"),
                              visible=bool(text),
                              styles={**_ERROR_STYLE, "color": "#b00020" if error else _WARNING_COLOR},
                              css_classes=["labavg-error" if error else "labavg-warning"])

    pn.bind(show, settings.param.errors, settings.param.warnings, watch=True)
    show()

    def enable(*_: Any) -> None:
        # A box the chosen method, payload or schedule has no use for is greyed out, not hidden.
        for name in ("momentum", "payload_bits", "post_local_frames"):
            widgets[name].disabled = settings.key_of(name) is None
        widgets["momentum"].name = settings.label("momentum")  # the chosen method's knob

    pn.bind(enable, settings.param.averaging, settings.param.payload,
            settings.param.average_schedule, watch=True)
    enable()

    def cell(name: str) -> pn.Column:
        widgets[name].param.update(sizing_mode="stretch_width", margin=(2, 5))
        return pn.Column(widgets[name], messages[name], sizing_mode="stretch_width", margin=0)

    names_in_rows = ("preset", *SETTINGS_ORDER)
    pairs = [pn.Row(*map(cell, names_in_rows[i:i + 2]), sizing_mode="stretch_width")
             for i in range(0, len(names_in_rows), 2)]
    return pn.Column(*pairs, cell("data"), cell("runs_dir"), sizing_mode="stretch_width")


class RunControls(pn.viewable.Viewer):
    """Start / Stop / Follow buttons and the status and run-configuration lines, each bound to
    the state it shows (`pn.bind`): Start is off while a run is on or a setting is wrong."""

    def __init__(self, settings: RunSettings, live: LiveRun, **params: Any) -> None:
        super().__init__(**params)
        self.settings, self.live = settings, live
        running, errors = live.param.running, settings.param.errors
        # Start stays off while any setting is wrong: a run never starts with a value the
        # page shows as refused (or with the value it had before).
        self.start_button = pn.widgets.Button(
            label="Start", color="primary", sizing_mode="stretch_width",
            disabled=pn.bind(lambda on, wrong: on or bool(wrong), running, errors))
        # A page that opens on a run in progress (a reload) has Stop on from the start.
        self.stop_button = pn.widgets.Button(label="Stop", color="danger", sizing_mode="stretch_width",
                                             disabled=pn.bind(lambda on: not on, running))
        self.follow_input = pn.widgets.TextInput(placeholder="run dir to follow",
                                                 sizing_mode="stretch_width")
        self.follow_button = pn.widgets.Button(label="Follow", sizing_mode="stretch_width",
                                               disabled=running)
        self.start_button.on_click(lambda _: self.live.start(self.settings))
        self.stop_button.on_click(lambda _: self.live.stop())
        self.follow_button.on_click(lambda _: self.live.follow(self.follow_input.value))
        problem = pn.bind(_problem_text, errors)
        self.problem = pn.pane.Markdown(problem, visible=pn.bind(bool, problem),
                                        sizing_mode="stretch_width", margin=(0, 8),
                                        styles=_ERROR_STYLE, stylesheets=_ERROR_SHEET,
                                        css_classes=["labavg-error"])
        self.status = pn.pane.Markdown(
            pn.bind(self._text, live.param.status, live.param.error, live.param.config,
                    live.param.run_dir, live.param.mode),
            sizing_mode="stretch_width", margin=(0, 10), styles={"font-size": "0.95em"})

    def _text(self, status: str, *_: Any) -> str:
        """The status line, then what the run on screen is (not what the settings say)."""
        # Shapes every sans-serif font has: an emoji (once an eye) was an empty box without
        # an emoji font.
        icon = {"live": "▶", "monitor": "◉", "idle": "■"}[self.live.mode]
        if not self.live.config:
            on_screen = "No run on screen."
        else:
            on_screen = f"On screen: `{Path(self.live.run_dir).name}` — {describe_config(self.live.config)}."
        return f"**{icon} {status}**  \n{on_screen} _Settings changes apply to the next run._"

    def status_view(self) -> pn.pane.Markdown:
        """The status line and what the run on screen is, kept up to date."""
        return self.status

    def __panel__(self) -> pn.Column:
        """Start/Stop side by side, why Start is off, then the monitor-mode input."""
        return pn.Column(pn.Row(self.start_button, self.stop_button, sizing_mode="stretch_width"),
                         self.problem,
                         pn.Row(self.follow_input, self.follow_button,
                                sizing_mode="stretch_width"),
                         sizing_mode="stretch_width")


def _problem_text(errors: dict[str, str]) -> str:
    """Why Start is off: the general problem, else how many settings to fix ('' when none)."""
    if not errors:
        return ""
    general = errors.get(GENERAL)
    text = general or (f"Fix {len(errors)} setting{'s' if len(errors) > 1 else ''} "
                       "marked below to start.")
    return text.replace("_", "\\_")
