"""A run records its agent (name and version) and its input in the shape
the agent declares: the runs before it were the research agent's, version 1,
on their question and documents."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("runs", "0018_alert_deliveries")]

    operations = [
        migrations.AddField(
            model_name="run",
            name="agent",
            field=models.CharField(default="research", max_length=63),
        ),
        migrations.AddField(
            model_name="run",
            name="agent_version",
            field=models.CharField(default="1", max_length=63),
        ),
        migrations.AddField(
            model_name="run",
            name="input",
            field=models.JSONField(default=dict),
        ),
        migrations.RunSQL(
            """UPDATE runs_run SET input = jsonb_build_object(
                   'question', question, 'documents', to_jsonb(documents))""",
            migrations.RunSQL.noop,
        ),
        migrations.AlterField(
            model_name="runevent",
            name="kind",
            field=models.CharField(
                choices=[
                    ("submitted", "Submitted"),
                    ("lease_acquired", "Lease Acquired"),
                    ("lease_released", "Lease Released"),
                    ("lease_lost", "Lease Lost"),
                    ("resumed", "Resumed"),
                    ("action_dispatched", "Action Dispatched"),
                    ("action_redispatched", "Action Redispatched"),
                    ("action_reused", "Action Reused"),
                    ("action_completed", "Action Completed"),
                    ("action_failed", "Action Failed"),
                    ("action_unknown", "Action Unknown"),
                    ("action_refused", "Action Refused"),
                    ("write_fenced", "Write Fenced"),
                    ("revision_published", "Revision Published"),
                    ("revision_kept", "Revision Kept"),
                    ("phase_changed", "Phase Changed"),
                    ("needs_operator", "Needs Operator"),
                    ("run_completed", "Run Completed"),
                    ("run_failed", "Run Failed"),
                    ("run_cancelled", "Run Cancelled"),
                    ("checkpoint_saved", "Checkpoint Saved"),
                    ("checkpoint_failed", "Checkpoint Failed"),
                    ("checkpoint_used", "Checkpoint Used"),
                    ("checkpoint_ignored", "Checkpoint Ignored"),
                    ("commit_unanswered", "Commit Unanswered"),
                    ("outcome_settled", "Outcome Settled"),
                    ("outcome_open", "Outcome Open"),
                    ("fault_injected", "Fault Injected"),
                    ("source_changed", "Source Changed"),
                    ("cancel_requested", "Cancel Requested"),
                    ("run_requeued", "Run Requeued"),
                    ("decision", "Decision"),
                    ("events_lost", "Events Lost"),
                ],
                max_length=40,
            ),
        ),
    ]
