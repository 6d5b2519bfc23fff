from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from dashboard import bulk, drills, holds, inbox, metrics, overview, saved_views, views
from dashboard.approvals import approval_decide

urlpatterns = [
    path("", views.runs_list, name="runs-list"),
    path("needs-you/", views.needs_you, name="needs-you"),
    path("runs/<int:run_id>/", views.run_detail, name="run-detail"),
    path("runs/<int:run_id>/live/", views.run_live, name="run-live"),
    path("runs/<int:run_id>/events/", views.run_events, name="run-events"),
    path("runs/<int:run_id>/cancel/", views.run_cancel, name="run-cancel"),
    path("runs/<int:run_id>/decide/", inbox.run_decide, name="run-decide"),
    path("runs/<int:run_id>/bundle/", views.run_bundle, name="run-bundle"),
    path("runs/<int:run_id>/bundles/", views.run_bundles, name="run-bundles"),
    path("bundles/<int:export_id>/download", views.bundle_download, name="bundle-download"),
    path("inbox/", inbox.inbox, name="inbox"),
    path("inbox/<int:item_id>/", inbox.item_detail, name="inbox-item"),
    path("inbox/<int:item_id>/decide/", inbox.item_decide, name="inbox-decide"),
    path("locks/", views.locks_list, name="locks"),
    path("locks/import/", views.locks_import, name="locks-import"),
    path("locks/<int:incident_id>/", views.lock_detail, name="lock-detail"),
    path("gaps/", views.gaps, name="gaps"),
    path("drills/", drills.drills, name="drills"),
    path("drills/start/", drills.drill_start, name="drill-start"),
    path("drills/<int:drill_id>/progress/", drills.drill_progress, name="drill-progress"),
    path("bulk/", bulk.bulk_jobs, name="bulk-jobs"),
    path("bulk/dry-run/", bulk.bulk_dry_run, name="bulk-dry-run"),
    path("bulk/confirm/", bulk.bulk_confirm, name="bulk-confirm"),
    path("bulk/selects/", bulk.bulk_selects, name="bulk-selects"),
    path("bulk/<int:job_id>/", bulk.bulk_job, name="bulk-job"),
    path("bulk/<int:job_id>/progress/", bulk.bulk_progress, name="bulk-progress"),
    path("bulk/<int:job_id>/stop/", bulk.bulk_stop, name="bulk-stop"),
    path("holds/", holds.holds_page, name="holds"),
    path("holds/add/", holds.hold_add, name="hold-add"),
    path("holds/<int:hold_id>/release/", holds.hold_release, name="hold-release"),
    path("overview/", overview.overview, name="overview"),
    path("views/save/", saved_views.view_save, name="view-save"),
    path("views/<int:view_id>/", saved_views.view_open, name="view-open"),
    path("views/<int:view_id>/delete/", saved_views.view_delete, name="view-delete"),
    path("login/", views.SignIn.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("api/", include("dashboard.api.urls")),
    path("inbox/<int:item_id>/approve/", approval_decide, name="inbox-approve"),
    path("metrics", metrics.metrics, name="metrics"),
]
