from django.urls import path

from costing import api, views

app_name = "costing"

urlpatterns = [
    path("", views.report_page, name="report"),
    path("prices/", views.price_book, name="prices"),
    path("prices/<int:pk>/delete/", views.price_delete, name="price-delete"),
    path("budgets/", views.budgets_page, name="budgets"),
    path("export.<str:kind>", views.export, name="export"),
]

api_urlpatterns = [
    path("costing/prices/", api.PriceViewSet.as_view({"get": "list", "post": "create"}), name="api-costing-prices"),
    path("costing/prices/<int:pk>/", api.PriceViewSet.as_view({"get": "retrieve", "delete": "destroy"}),
         name="api-costing-price"),
    path("costing/list-prices/", api.ListPriceViewSet.as_view({"get": "list", "post": "create"}),
         name="api-costing-list-prices"),
    path("costing/budgets/", api.BudgetViewSet.as_view({"get": "list", "post": "create"}),
         name="api-costing-budgets"),
    path("costing/budgets/<int:pk>/",
         api.BudgetViewSet.as_view({"get": "retrieve", "patch": "partial_update", "delete": "destroy"}),
         name="api-costing-budget"),
    path("costing/report/", api.Report.as_view(), name="api-costing-report"),
    path("models/<str:name>/compare/", api.VersionCompare.as_view(), name="api-model-compare"),
]
