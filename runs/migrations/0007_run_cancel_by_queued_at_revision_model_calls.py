# A publication names the model calls it used on its own row and touches no
# evidence table, so it has nothing to roll back when fenced out:
# rundesk_fenced_out() goes.  A cancel says who asked; a queued run says
# since when (the sweep hands out again a run nobody took for long).

import importlib

import django.contrib.postgres.fields
import django.db.models.functions.datetime
from django.db import migrations, models


# Revisions published before this migration: the model calls the run had
# recorded by then, which a publication marked (the last one to mark a call
# left its number: at least this revision's).  Revisions are immutable (a
# trigger); the new column is filled once, here, with the trigger off.
BACKFILL = """
ALTER TABLE runs_answerrevision DISABLE TRIGGER runs_answerrevision_immutable;
UPDATE runs_answerrevision r SET model_call_actions = coalesce((
    SELECT array_agg(m.action_id ORDER BY m.action_id) FROM evidence_modelcall m
    WHERE m.run_id = r.run_id AND m.published_revision >= r.number
      AND m.created_at <= r.committed_at), '{}');
ALTER TABLE runs_answerrevision ENABLE TRIGGER runs_answerrevision_immutable;
"""

FENCED_OUT = importlib.import_module("runs.migrations.0006_fenced_out").FUNCTION


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0006_fenced_out'),
        # The backfill reads the model calls' old marks (dropped by evidence 0002).
        ('evidence', '0001_initial'),
    ]

    operations = [
        migrations.AddField(
            model_name='answerrevision',
            name='model_call_actions',
            field=django.contrib.postgres.fields.ArrayField(base_field=models.BigIntegerField(), blank=True, default=list, size=None),
        ),
        migrations.AddField(
            model_name='run',
            name='cancel_requested_by',
            field=models.CharField(blank=True, max_length=150),
        ),
        migrations.AddField(
            model_name='run',
            name='queued_at',
            field=models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
        ),
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop),
        migrations.RunSQL("DROP FUNCTION rundesk_fenced_out();", FENCED_OUT),
        migrations.AlterField(
            model_name='runevent',
            name='kind',
            field=models.CharField(choices=[('submitted', 'Submitted'), ('lease_acquired', 'Lease Acquired'), ('lease_released', 'Lease Released'), ('lease_lost', 'Lease Lost'), ('resumed', 'Resumed'), ('action_dispatched', 'Action Dispatched'), ('action_redispatched', 'Action Redispatched'), ('action_reused', 'Action Reused'), ('action_completed', 'Action Completed'), ('action_failed', 'Action Failed'), ('action_unknown', 'Action Unknown'), ('write_fenced', 'Write Fenced'), ('revision_published', 'Revision Published'), ('phase_changed', 'Phase Changed'), ('needs_operator', 'Needs Operator'), ('run_completed', 'Run Completed'), ('run_failed', 'Run Failed'), ('run_cancelled', 'Run Cancelled'), ('checkpoint_saved', 'Checkpoint Saved'), ('checkpoint_failed', 'Checkpoint Failed'), ('checkpoint_used', 'Checkpoint Used'), ('checkpoint_ignored', 'Checkpoint Ignored'), ('commit_unanswered', 'Commit Unanswered'), ('outcome_settled', 'Outcome Settled'), ('outcome_open', 'Outcome Open'), ('fault_injected', 'Fault Injected'), ('source_changed', 'Source Changed'), ('cancel_requested', 'Cancel Requested'), ('run_requeued', 'Run Requeued'), ('events_lost', 'Events Lost')], max_length=40),
        ),
    ]
