from django.apps import AppConfig


class CostingConfig(AppConfig):
    name = "costing"
    verbose_name = "Costs: price book, ledger, budgets and monthly reports"

    def ready(self) -> None:
        # The home page shows this month's cost so far; inferops imports no feature app.
        from costing import eval_costs, panels, usage
        from evals.signals import run_finished
        from inferops import usage_pipeline
        from inferops.panels import home_panels

        home_panels.register(panels.home_panel, panels.COSTS)
        # Hourly usage and SLO-compliant tokens are added at ingest, from the SLO fold's verdicts.
        usage_pipeline.register(usage.fold_events, stage=usage_pipeline.AGGREGATE)
        # An eval run's usd "from costing": priced once it finishes (evals sits below costing).
        run_finished.connect(eval_costs.price_finished_run, dispatch_uid="costing.price_finished_run")
