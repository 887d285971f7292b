"""VRAM planner pane: a model, a context, cache bits and GPU memory in; a stacked bar of weights /
KV cache / activations / overhead against capacity, the largest context that fits, and advice out.

All numbers come from engine.plan (pure arithmetic), recomputed on every change — it is cheap."""
from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel,
                               QPushButton, QSpinBox, QVBoxLayout, QWidget)

from app.engine_client import kernels_caveat
from engine import plan as planner
from engine.errors import TrellisError

PART_COLORS = {"weights": "#4e79a7", "kv_cache": "#f28e2b", "activations": "#59a14f", "overhead": "#9c755f"}
PART_NAMES = {"weights": "Weights", "kv_cache": "KV cache", "activations": "Activations", "overhead": "Overhead"}
CACHE_CHOICES = ["fp16", "8", "6", "5", "4", "3", "2"]


class StackedBar(QWidget):
    """One horizontal bar: the parts side by side, a line where capacity ends."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.plan: planner.Plan | None = None
        self.setMinimumHeight(92)

    def set_plan(self, plan: planner.Plan | None) -> None:
        self.plan = plan
        self.update()

    def paintEvent(self, _):
        p = QPainter(self)
        p.setRenderHint(QPainter.Antialiasing)
        r = QRectF(self.rect()).adjusted(2, 22, -2, -26)
        pal = self.palette()
        p.setPen(Qt.NoPen)
        p.setBrush(pal.alternateBase())
        p.drawRoundedRect(r, 6, 6)
        if self.plan is None:
            return
        cap = self.plan.capacity or 0
        scale_max = max(self.plan.total, cap) * 1.05 or 1
        x = r.left()
        for key, color in PART_COLORS.items():
            w = r.width() * getattr(self.plan, key) / scale_max
            p.setBrush(QColor(color))
            p.drawRect(QRectF(x, r.top(), max(w, 0), r.height()))
            x += w
        p.setPen(pal.color(pal.ColorRole.WindowText))
        font = p.font()
        font.setPointSizeF(font.pointSizeF() * 0.9)
        p.setFont(font)
        p.drawText(QRectF(r.left(), 0, r.width(), 20), Qt.AlignLeft | Qt.AlignVCenter,
                   f"needs {self.plan.total / planner.GiB:.2f} GiB")
        if cap:
            cx = r.left() + r.width() * cap / scale_max
            p.setPen(QPen(QColor("#c62828" if not self.plan.fits else "#2e7d32"), 2, Qt.DashLine))
            p.drawLine(int(cx), int(r.top() - 6), int(cx), int(r.bottom() + 6))
            p.setPen(pal.color(pal.ColorRole.WindowText))
            p.drawText(QRectF(cx - 160, r.bottom() + 6, 156, 20), Qt.AlignRight | Qt.AlignVCenter,
                       f"capacity {cap / planner.GiB:.1f} GiB")
        p.end()


class PlannerPane(QWidget):
    def __init__(self, client, library=None, parent=None):
        super().__init__(parent)
        self.client = client
        self.library = library
        self.spec: planner.ModelSpec | None = None
        self.last_plan: planner.Plan | None = None

        self.model_box = QComboBox()
        self.model_box.setEditable(True)
        self.model_box.setMinimumWidth(360)
        self.model_box.lineEdit().setPlaceholderText("a model folder, or a config.json")
        self.model_box.lineEdit().editingFinished.connect(lambda: self.set_model(self.model_box.currentText()))
        self.model_box.activated.connect(lambda i: self.set_model(self.model_box.itemData(i) or self.model_box.itemText(i)))
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        mrow = QHBoxLayout()
        mrow.addWidget(self.model_box, 1)
        mrow.addWidget(browse)
        self.context = QSpinBox()
        self.context.setRange(256, 1 << 21)
        self.context.setSingleStep(1024)
        self.context.setValue(4096)
        self.batch = QSpinBox()
        self.batch.setRange(1, 256)
        self.k_bits = QComboBox()
        self.k_bits.addItems(CACHE_CHOICES)
        self.v_bits = QComboBox()
        self.v_bits.addItems(CACHE_CHOICES)
        bits = QHBoxLayout()
        bits.addWidget(QLabel("K"))
        bits.addWidget(self.k_bits)
        bits.addWidget(QLabel("V"))
        bits.addWidget(self.v_bits)
        bits.addStretch(1)
        self.gpu_mem = QDoubleSpinBox()
        self.gpu_mem.setRange(0.5, 4096)
        self.gpu_mem.setDecimals(1)
        self.gpu_mem.setSuffix(" GiB")
        self.gpu_mem.setValue(24.0)
        self.gpus = QSpinBox()
        self.gpus.setRange(1, 16)
        self.gpu_source = QLabel("typed in (no GPU reported by the engine)")
        self.gpu_source.setObjectName("muted")
        grow = QHBoxLayout()
        grow.addWidget(self.gpu_mem)
        grow.addWidget(QLabel("×"))
        grow.addWidget(self.gpus)
        grow.addWidget(self.gpu_source, 1)

        form = QFormLayout()
        form.addRow("Model", mrow)
        form.addRow("Context (tokens)", self.context)
        form.addRow("Concurrent sequences", self.batch)
        form.addRow("KV cache bits", bits)
        form.addRow("Free memory per GPU", grow)

        self.bar = StackedBar()
        self.legend = QLabel()
        self.legend.setTextFormat(Qt.RichText)
        self.verdict = QLabel()
        self.verdict.setObjectName("verdict")
        self.largest = QLabel()
        self.advice = QLabel()
        self.advice.setWordWrap(True)
        self.advice.setObjectName("advice")
        self.measured = QLabel()
        self.measured.setObjectName("muted")
        self.measured.setWordWrap(True)
        self.source_path: str | None = None

        lay = QVBoxLayout(self)
        title = QLabel("VRAM planner")
        title.setObjectName("paneTitle")
        lay.addWidget(title)
        lay.addLayout(form)
        lay.addSpacing(8)
        lay.addWidget(self.verdict)
        lay.addWidget(self.bar)
        lay.addWidget(self.legend)
        lay.addWidget(self.largest)
        lay.addWidget(self.advice)
        lay.addWidget(self.measured)
        lay.addStretch(1)

        for w in (self.context, self.batch, self.gpus, self.gpu_mem):
            w.setMaximumWidth(140)
        self.gpus.setMaximumWidth(60)
        for w in (self.context, self.batch, self.gpus):
            w.valueChanged.connect(self.recompute)
        self.gpu_mem.valueChanged.connect(self.recompute)
        self.k_bits.currentTextChanged.connect(self.recompute)
        self.v_bits.currentTextChanged.connect(self.recompute)
        client.ready.connect(lambda *_: self._take_devices())
        client.model_changed.connect(lambda *_: self._show_measured())
        client.status_report.connect(lambda *_: self._take_devices())
        if library is not None:
            library.scanned.connect(self._fill_models)
        self._take_devices()
        self.recompute()

    # ------------------------------------------------------------------ inputs
    def _fill_models(self) -> None:
        current = self.model_box.currentText()
        self.model_box.blockSignals(True)
        self.model_box.clear()
        for e in self.library.model.entries:
            if e.kind in ("exl3", "hf"):
                self.model_box.addItem(f"{e.name}  ({e.bpw:.2f} bpw)" if e.bpw else e.name, e.path)
        self.model_box.setEditText(current)
        self.model_box.blockSignals(False)
        if self.spec is None and self.model_box.count():
            self.set_model(self.model_box.itemData(0))

    def _browse(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Model folder", str(Path.home()))
        if path:
            self.set_model(path)

    def _take_devices(self) -> None:
        gpus = [d for d in self.client.devices if d.device.startswith("cuda")]
        if gpus:
            self.gpu_mem.setValue(min(d.free_bytes for d in gpus) / planner.GiB)
            self.gpus.setValue(len(gpus))
            caveat = kernels_caveat(self.client.hello)
            self.gpu_source.setText(f"from the engine: {', '.join(d.name or d.device for d in gpus)}" +
                                    (" · without CUDA kernels: weights count dense" if caveat else ""))
            self.gpu_source.setToolTip(caveat)
        else:
            self.gpu_source.setText("typed in (the engine reports no GPU)")

    def set_model(self, source) -> None:
        """A model folder, a config.json path, or a config dict (a hub model's config)."""
        self.source_path = None
        try:
            if isinstance(source, dict):
                self.spec = planner.spec_from_config(source, name=source.get("_name_or_path", "hub model"))
                self.model_box.setEditText(f"{self.spec.name} (hub config: weights estimated)")
            else:
                p = Path(str(source)).expanduser()
                if p.is_file() and p.suffix == ".json":
                    self.spec = planner.spec_from_config(json.loads(p.read_text()), name=p.parent.name)
                else:
                    self.spec = planner.spec_from_dir(p)
                    self.model_box.setEditText(str(p))
                    self.source_path = str(p)
        except (TrellisError, OSError, ValueError) as e:
            self.spec = None
            self.last_plan = None
            self.bar.set_plan(None)
            self.verdict.setText("")
            self.legend.setText("")
            self.largest.setText("")
            self.advice.setText(f"Cannot plan: {e}")
            return
        if self.spec.max_context:
            self.context.setMaximum(max(self.spec.max_context, 256))
        self.recompute()

    # ------------------------------------------------------------------ output
    def request(self) -> planner.PlanRequest:
        kb = None if self.k_bits.currentText() == "fp16" else int(self.k_bits.currentText())
        vb = None if self.v_bits.currentText() == "fp16" else int(self.v_bits.currentText())
        return planner.PlanRequest(context=self.context.value(), batch=self.batch.value(), k_bits=kb, v_bits=vb,
                                   gpu_bytes=[int(self.gpu_mem.value() * planner.GiB)] * self.gpus.value(),
                                   without_kernels=kernels_caveat(self.client.hello))

    def recompute(self) -> None:
        if self.spec is None:
            if not self.advice.text():
                self.advice.setText("Pick a model to see whether it fits.")
            return
        try:
            plan = planner.plan(self.spec, self.request())
        except TrellisError as e:
            self.advice.setText(str(e))
            return
        self.last_plan = plan
        self.bar.set_plan(plan)
        gib = lambda b: f"{b / planner.GiB:.2f} GiB" if b >= planner.GiB // 2 else f"{b / planner.MiB:.1f} MiB"
        self.legend.setText("&nbsp;&nbsp;&nbsp;".join(
            f'<span style="color:{c}">■</span> {PART_NAMES[k]} {gib(getattr(plan, k))}' for k, c in PART_COLORS.items())
            + ("" if plan.weights_exact else "&nbsp;&nbsp;(weights estimated from config)"))
        ok = plan.fits
        self.verdict.setText(f"{'Fits' if ok else 'Does not fit'}: {gib(plan.total)} of {gib(plan.capacity)}")
        self.verdict.setProperty("fits", bool(ok))
        self.verdict.style().unpolish(self.verdict)
        self.verdict.style().polish(self.verdict)
        cap = "" if plan.largest_context != plan.model_max_context else " (the model's own limit)"
        self.largest.setText(f"Largest context that fits: {plan.largest_context:,} tokens{cap}")
        self.advice.setText(plan.advice)
        self._show_measured()

    def _show_measured(self) -> None:
        """Predicted vs what the engine measured, when the loaded model is the one planned."""
        m = self.client.model or {}
        if not m or self.source_path is None or m.get("model_dir") != self.source_path or self.last_plan is None:
            self.measured.setText("")
            return
        w, c = m.get("weight_bytes") or 0, m.get("cache_bytes") or 0
        mib = lambda b: f"{b / planner.MiB:,.1f} MiB"
        ctx = m.get("max_context") or "?"
        self.measured.setText(f"Loaded on {m.get('device', '?')} with {ctx} tokens of context — measured: weights "
                              f"{mib(w)}, KV cache {mib(c)}; predicted: weights {mib(self.spec.weight_bytes)}, "
                              f"KV cache {mib(planner.kv_cache_bytes(self.spec, int(ctx) if str(ctx).isdigit() else 1))}.")
