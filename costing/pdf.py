"""The monthly report as a PDF (ReportLab), with its charts drawn as PDF vector graphics.

Money reads in cents with thousands separators (costing.report.report_in_cents: each table adds up
to its total); $/MTok and unit prices keep their own precision, as their headers say.
"""

from __future__ import annotations

import io
from datetime import datetime
from decimal import Decimal

from reportlab.graphics.charts.barcharts import HorizontalBarChart, VerticalBarChart
from reportlab.graphics.charts.legends import Legend
from reportlab.graphics.shapes import Drawing, String
from reportlab.lib import colors
from reportlab.lib.pagesizes import A4
from reportlab.lib.styles import getSampleStyleSheet
from reportlab.lib.units import mm
from reportlab.pdfgen.canvas import Canvas
from reportlab.platypus import Paragraph, SimpleDocTemplate, Spacer, Table, TableStyle

from costing.report import NOT_MEASURED, allocation_method, gpu_busy_text, report_in_cents
from inferops.numbers import grouped

PALETTE = [colors.HexColor(c) for c in ("#2453d4", "#1f8a4c", "#b7791f", "#c53030", "#6b46c1", "#0e7490",
                                        "#be185d", "#4d7c0f", "#92400e", "#334155")]
TOP = 15  # tenants and deployments named in a chart; the rest are summed as "others"


def _table(rows: list[list], widths=None) -> Table:
    table = Table(rows, colWidths=widths, repeatRows=1)
    table.setStyle(TableStyle([
        ("FONT", (0, 0), (-1, 0), "Helvetica-Bold", 8), ("FONT", (0, 1), (-1, -1), "Helvetica", 8),
        ("BACKGROUND", (0, 0), (-1, 0), colors.HexColor("#eef1f5")),
        ("GRID", (0, 0), (-1, -1), 0.25, colors.HexColor("#dde2ea")), ("ALIGN", (1, 1), (-1, -1), "RIGHT"),
    ]))
    return table


def daily_chart(report: dict) -> Drawing:
    """Daily cost stacked by deployment (the top ones; the rest as others)."""
    daily = report["daily"]
    ranked = [row["deployment"] for row in report["by_deployment"]]
    shown = ranked[:len(PALETTE) - 1]
    series = []
    for name in shown:
        series.append([float(Decimal(day["by_deployment"].get(name) or 0)) for day in daily])
    rest = [float(sum((Decimal(v or 0) for n, v in day["by_deployment"].items() if n not in shown), Decimal(0)))
            for day in daily]
    names = list(shown)
    if any(rest):
        series.append(rest)
        names.append("others")
    drawing = Drawing(170 * mm, 75 * mm)
    drawing.add(String(0, 72 * mm, "Daily cost by deployment (USD)", fontName="Helvetica-Bold", fontSize=9))
    chart = VerticalBarChart()
    chart.x, chart.y, chart.width, chart.height = 12 * mm, 12 * mm, 115 * mm, 55 * mm
    chart.data = series or [[0]]
    chart.categoryAxis.style = "stacked"
    chart.categoryAxis.categoryNames = [day["date"][8:] for day in daily] or [""]
    chart.categoryAxis.labels.fontSize = 6
    chart.valueAxis.labels.fontSize = 7
    chart.valueAxis.valueMin = 0
    for i in range(len(series)):
        chart.bars[i].fillColor = PALETTE[i % len(PALETTE)]
        chart.bars[i].strokeColor = None
    drawing.add(chart)
    legend = Legend()
    legend.x, legend.y = 132 * mm, 62 * mm
    legend.fontSize = 7
    legend.alignment = "right"
    legend.colorNamePairs = [(PALETTE[i % len(PALETTE)], name) for i, name in enumerate(names)]
    drawing.add(legend)
    return drawing


def tenant_chart(report: dict) -> Drawing:
    rows = report["by_tenant"][:TOP]
    drawing = Drawing(170 * mm, (20 + 6 * max(len(rows), 1)) * mm)
    drawing.add(String(0, drawing.height - 4 * mm, "Cost by tenant (USD)", fontName="Helvetica-Bold", fontSize=9))
    chart = HorizontalBarChart()
    chart.x, chart.y = 35 * mm, 8 * mm
    chart.width, chart.height = 120 * mm, drawing.height - 18 * mm
    chart.data = [[float(Decimal(row["usd"])) for row in reversed(rows)] or [0]]
    chart.categoryAxis.categoryNames = [row["tenant"] for row in reversed(rows)] or [""]
    chart.categoryAxis.labels.fontSize = 7
    chart.valueAxis.labels.fontSize = 7
    chart.valueAxis.valueMin = 0
    chart.bars[0].fillColor = PALETTE[0]
    drawing.add(chart)
    return drawing


class NumberedCanvas(Canvas):
    """Holds each page until the last is drawn, so every footer can say "Page N of M"."""

    footer = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pages = []

    def showPage(self):  # noqa: N802 (ReportLab's name)
        self._pages.append(dict(self.__dict__))
        self._startPage()

    def save(self):
        for state in self._pages:
            self.__dict__.update(state)
            self.setFont("Helvetica", 7)
            self.setFillColor(colors.HexColor("#5b6578"))
            self.drawString(18 * mm, 9 * mm, self.footer)
            self.drawRightString(A4[0] - 18 * mm, 9 * mm, f"Page {self._pageNumber} of {len(self._pages)}")
            super().showPage()
        super().save()


def _footed(footer: str) -> type[NumberedCanvas]:
    return type("FootedCanvas", (NumberedCanvas,), {"footer": footer})


def _utc(moment: datetime | str | None) -> str:
    if moment is None:
        return "open"
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    return f"{moment:%Y-%m-%d %H:%M} UTC"


def prices_table(prices: list[dict]) -> Table:
    return _table(
        [["What", "Unit", "USD per unit (up to 6 decimals)", "Effective from", "Effective to"]]
        + [[row["what"], row["unit"], grouped(row["usd"]), _utc(row["effective_from"]), _utc(row["effective_to"])]
           for row in prices])


def report_pdf(report: dict, *, prices: list[dict], generated_at: datetime) -> bytes:
    """`report` as the API answers it; `prices`: costing.report.prices_in_effect of its period."""
    allocation = allocation_method(report)
    report = report_in_cents(report)
    currency = report["currency"]
    styles = getSampleStyleSheet()
    styles["Heading2"].keepWithNext = 1  # no heading alone at the foot of a page
    buffer = io.BytesIO()
    period = f"{report['start'][:10]} to {report['end'][:10]}"
    doc = SimpleDocTemplate(buffer, pagesize=A4, leftMargin=18 * mm, rightMargin=18 * mm, topMargin=16 * mm,
                            bottomMargin=18 * mm, author="inferops", title=f"inferops costs {period}")
    state = f"closed {report['closed_at'][:10]}" if report["closed"] else "open month"
    story = [
        Paragraph(f"Serving costs {period} (UTC)", styles["Title"]),
        Paragraph(f"inferops cost report, {state}. Generated {generated_at:%Y-%m-%d %H:%M:%S} UTC. "
                  f"Amounts in {currency} ($), to the cent; $ / 1M tokens to 4 decimals.", styles["Normal"]),
        Spacer(1, 4 * mm),
        _table([
            [f"Total cost ({currency})", f"Idle ({currency})", "Prompt tokens", "Completion tokens",
             f"{currency} / 1M tokens (4 dp)", f"{currency} / 1M SLO-compliant (4 dp)"],
            [grouped(report["total_usd"]), grouped(report["idle_usd"]), grouped(report["prompt_tokens"]),
             grouped(report["completion_tokens"]), grouped(report["usd_per_mtok"]) or "-",
             grouped(report["usd_per_mtok_slo_compliant"]) or "-"],
        ]),
    ]
    if report.get("revenue_usd"):
        story += [Spacer(1, 2 * mm), Paragraph(
            f"Revenue at list prices {currency} {grouped(report['revenue_usd'])}, "
            f"margin {currency} {grouped(report['margin_usd'])}.", styles["Normal"])]
    if report.get("batch_tokens"):
        revenue = (f", revenue at the batch price {currency} {grouped(report['batch_revenue_usd'])}"
                   if report.get("batch_revenue_usd") is not None else "")
        story += [Spacer(1, 2 * mm), Paragraph(
            f"Offline batches: {grouped(report['batch_tokens'])} tokens, their share of the cost "
            f"{currency} {grouped(report['batch_usd'])}{revenue} (included in the figures above).", styles["Normal"])]
    for note in report.get("notes", []):
        story += [Spacer(1, 2 * mm), Paragraph(note, styles["Italic"])]
    story += [Paragraph("Allocation method", styles["Heading2"]), Paragraph(allocation, styles["Normal"])]
    story += [Spacer(1, 5 * mm), daily_chart(report), Spacer(1, 4 * mm), tenant_chart(report)]
    # The batch columns: offline batches' part of the tokens and of the cost (.get: a month closed
    # before batches were billed has none).
    story += [Paragraph("By tenant", styles["Heading2"]), _table(
        [["Tenant", f"Cost ({currency})", "Prompt tokens", "Completion tokens", f"{currency} / 1M tokens (4 dp)",
          "Batch tokens", f"Batch cost ({currency})"]]
        + [[row["tenant"], grouped(row["usd"]), grouped(row["prompt_tokens"]), grouped(row["completion_tokens"]),
            grouped(row["usd_per_mtok"]) or "-", grouped(row.get("batch_tokens", 0)),
            grouped(row.get("batch_usd") or "0.00")] for row in report["by_tenant"]]
        + [["idle (no traffic)", grouped(report["idle_usd"]), "", "", "", "", ""],
           ["Total", grouped(report["total_usd"]), grouped(report["prompt_tokens"]),
            grouped(report["completion_tokens"]), grouped(report["usd_per_mtok"]) or "-",
            grouped(report.get("batch_tokens", 0)), grouped(report.get("batch_usd") or "0.00")]])]
    story += [Paragraph("By deployment", styles["Heading2"]), _table(
        [["Deployment", "Model", f"Cost ({currency})", f"Idle ({currency})", "Replica hours",
          f"{currency} / 1M tokens (4 dp)", f"{currency} / 1M SLO-compliant (4 dp)"]]
        + [[row["deployment"], row["model"], grouped(row["usd"]), grouped(row["idle_usd"]),
            grouped(row["replica_hours"]), grouped(row["usd_per_mtok"]) or "-",
            grouped(row["usd_per_mtok_slo_compliant"]) or "-"]
           for row in report["by_deployment"]])]
    gpu_rows = [row for row in report["by_deployment"] if gpu_busy_text(row)]
    if gpu_rows:  # none in a month without GPUs, or closed before GPU telemetry
        story += [Paragraph("GPU-hours", styles["Heading2"]), _table(
            [["Deployment", "GPU-hours", "Busy GPU-hours", "GPU busy", "GPU-hours not measured"]]
            + [[row["deployment"], grouped(row["gpu_hours"]), grouped(row["gpu_hours_busy"]),
                NOT_MEASURED if row["gpu_busy_share"] is None else f"{Decimal(row['gpu_busy_share']) * 100:.1f} %",
                grouped(row["gpu_hours_not_measured"])] for row in gpu_rows]
            + [["Total", grouped(report["gpu_hours"]), grouped(report["gpu_hours_busy"]),
                gpu_busy_text(report).split(" (")[0], grouped(report["gpu_hours_not_measured"])]]),
            Spacer(1, 2 * mm), Paragraph(
                "GPU-hours: the minutes each replica ran times the GPUs it held, as priced. GPU busy: busy "
                "GPU-hours (each minute's mean utilisation of the replica's GPUs times its GPUs and the minute, "
                "from GPU telemetry) over the GPU-hours that telemetry measured. GPU-hours no telemetry covered "
                "are not measured, not idle.", styles["Normal"])]
    story += [Paragraph("Prices in effect", styles["Heading2"]),
              prices_table(prices) if prices else Paragraph("No price covered this period.", styles["Normal"])]
    doc.build(story, canvasmaker=_footed(f"inferops cost report {period} (UTC), generated "
                                         f"{generated_at:%Y-%m-%d %H:%M:%S} UTC"))
    return buffer.getvalue()
