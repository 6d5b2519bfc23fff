import django.db.models.deletion
from django.db import migrations, models

# Incidents opened with a bundle before this migration: each wait of one
# names the imported run it came with, or no run (the other installation's
# runs are unknown here); a local incident's waits name local runs.  Their
# report_digest (taken from the bundle then) is cleared: it stopped this
# server's own log from being imported.
MARK_IMPORTED = """
    WITH sides AS (
        SELECT w.incident_id, r.id AS run_id, r.imported_at IS NOT NULL AS imported
        FROM evidence_lockwait w
        JOIN runs_run r ON r.id IN (w.waiter_run_id, w.blocker_run_id)
    ), owner AS (
        SELECT incident_id, min(run_id) AS run_id FROM sides
        GROUP BY incident_id
        HAVING bool_and(imported) AND count(DISTINCT run_id) = 1
    )
    UPDATE evidence_lockincident AS i
    SET imported_run_id = owner.run_id, report_digest = ''
    FROM owner WHERE i.id = owner.incident_id
"""


class Migration(migrations.Migration):
    dependencies = [
        ("evidence", "0006_lock_incident_report_digest"),
        ("runs", "0015_checkpoint_unknown_idx"),
    ]

    operations = [
        migrations.AddField(
            model_name="lockincident",
            name="imported_run",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="imported_lock_incidents",
                to="runs.run",
            ),
        ),
        # Checked at once: a deferred check pending at the ALTER TABLE below
        # would refuse it.
        migrations.RunSQL(["SET CONSTRAINTS ALL IMMEDIATE", MARK_IMPORTED], migrations.RunSQL.noop),
        migrations.AddConstraint(
            model_name="lockincident",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("imported_run__isnull", True), ("report_digest", ""), _connector="OR"
                ),
                name="incident_imported_not_a_log_import",
            ),
        ),
    ]
