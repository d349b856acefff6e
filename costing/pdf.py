"""The monthly report as a PDF (ReportLab), with its charts drawn as PDF vector graphics."""

from __future__ import annotations

import io
from decimal import Decimal

from reportlab.graphics.charts.barcharts import HorizontalBarChart, VerticalBarChart
from reportlab.graphics.charts.legends import Legend
from reportlab.graphics.shapes import Drawing, String
from reportlab.lib import colors
from reportlab.lib.pagesizes import A4
from reportlab.lib.styles import getSampleStyleSheet
from reportlab.lib.units import mm
from reportlab.platypus import Paragraph, SimpleDocTemplate, Spacer, Table, TableStyle

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


def report_pdf(report: dict) -> bytes:
    styles = getSampleStyleSheet()
    buffer = io.BytesIO()
    doc = SimpleDocTemplate(buffer, pagesize=A4, leftMargin=18 * mm, rightMargin=18 * mm, topMargin=16 * mm,
                            bottomMargin=16 * mm, author="inferops",
                            title=f"inferops costs {report['start'][:10]} to {report['end'][:10]}",
                            )
    state = f"closed {report['closed_at'][:10]}" if report["closed"] else "open month"
    story = [
        Paragraph(f"Serving costs {report['start'][:10]} to {report['end'][:10]} (UTC)", styles["Title"]),
        Paragraph(f"inferops cost report, {state}. Amounts in {report['currency']}.", styles["Normal"]),
        Spacer(1, 4 * mm),
        _table([
            ["Total cost", "Idle", "Prompt tokens", "Completion tokens", "$ / 1M tokens", "$ / 1M SLO-compliant"],
            [report["total_usd"], report["idle_usd"], f"{report['prompt_tokens']:,}",
             f"{report['completion_tokens']:,}", report["usd_per_mtok"] or "-",
             report["usd_per_mtok_slo_compliant"] or "-"],
        ]),
    ]
    if report.get("revenue_usd"):
        story += [Spacer(1, 2 * mm), Paragraph(
            f"Revenue at list prices {report['revenue_usd']}, margin {report['margin_usd']}.", styles["Normal"])]
    for note in report.get("notes", []):
        story += [Spacer(1, 2 * mm), Paragraph(note, styles["Italic"])]
    story += [Spacer(1, 5 * mm), daily_chart(report), Spacer(1, 4 * mm), tenant_chart(report)]
    story += [Paragraph("By tenant", styles["Heading2"]), _table(
        [["Tenant", "Cost", "Prompt tokens", "Completion tokens", "$ / 1M tokens"]]
        + [[row["tenant"], row["usd"], f"{row['prompt_tokens']:,}", f"{row['completion_tokens']:,}",
            row["usd_per_mtok"] or "-"] for row in report["by_tenant"]]
        + [["idle (no traffic)", report["idle_usd"], "", "", ""]])]
    story += [Paragraph("By deployment", styles["Heading2"]), _table(
        [["Deployment", "Model", "Cost", "Idle", "Replica hours", "$ / 1M tokens", "$ / 1M SLO-compliant"]]
        + [[row["deployment"], row["model"], row["usd"], row["idle_usd"], row["replica_hours"],
            row["usd_per_mtok"] or "-", row["usd_per_mtok_slo_compliant"] or "-"] for row in report["by_deployment"]])]
    doc.build(story)
    return buffer.getvalue()
