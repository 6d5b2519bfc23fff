# A publication names the model calls it used on its own row and touches no
# evidence table, so it has nothing to roll back when fenced out:
# rundesk_fenced_out() goes.  A cancel says who asked; a queued run says
# since when (the sweep hands out again a run nobody took for long).

import importlib

import django.contrib.postgres.fields
import django.db.models.functions.datetime
from django.db import migrations, models


FENCED_OUT = importlib.import_module("runs.migrations.0006_fenced_out").FUNCTION


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0006_fenced_out'),
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
        migrations.RunSQL("DROP FUNCTION rundesk_fenced_out();", FENCED_OUT),
        migrations.AlterField(
            model_name='runevent',
            name='kind',
            field=models.CharField(choices=[('submitted', 'Submitted'), ('lease_acquired', 'Lease Acquired'), ('lease_released', 'Lease Released'), ('lease_lost', 'Lease Lost'), ('resumed', 'Resumed'), ('action_dispatched', 'Action Dispatched'), ('action_redispatched', 'Action Redispatched'), ('action_reused', 'Action Reused'), ('action_completed', 'Action Completed'), ('action_failed', 'Action Failed'), ('action_unknown', 'Action Unknown'), ('write_fenced', 'Write Fenced'), ('revision_published', 'Revision Published'), ('phase_changed', 'Phase Changed'), ('needs_operator', 'Needs Operator'), ('run_completed', 'Run Completed'), ('run_failed', 'Run Failed'), ('run_cancelled', 'Run Cancelled'), ('checkpoint_saved', 'Checkpoint Saved'), ('checkpoint_failed', 'Checkpoint Failed'), ('checkpoint_used', 'Checkpoint Used'), ('checkpoint_ignored', 'Checkpoint Ignored'), ('commit_unanswered', 'Commit Unanswered'), ('outcome_settled', 'Outcome Settled'), ('outcome_open', 'Outcome Open'), ('fault_injected', 'Fault Injected'), ('source_changed', 'Source Changed'), ('cancel_requested', 'Cancel Requested'), ('run_requeued', 'Run Requeued'), ('events_lost', 'Events Lost')], max_length=40),
        ),
    ]
