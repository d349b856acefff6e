from django.apps import AppConfig


class CostingConfig(AppConfig):
    name = "costing"
    verbose_name = "Costs: price book, ledger, budgets and monthly reports"

    def ready(self) -> None:
        # The home page shows this month's cost so far; inferops imports no feature app.
        from costing import panels
        from inferops.panels import home_panels

        home_panels.register(panels.home_panel, panels.COSTS)
