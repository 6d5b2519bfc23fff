# Operators' decisions are records: the database refuses to change or delete
# them.  An effect is dispatched once under its identity, and again only as
# often as decisions authorise it (resend_same_identity,
# confirmed_not_happened): a trigger counts them, where a CHECK could not.

import django.db.models.deletion
import django.db.models.functions.datetime
from django.conf import settings
from django.db import migrations, models


DISPATCHES = """
CREATE FUNCTION rundesk_effect_dispatches() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.effect_class = 'effect' AND NEW.attempts > 1 + (
        SELECT count(*) FROM runs_operatordecision d
        WHERE d.action_id = NEW.id
          AND d.choice IN ('resend_same_identity', 'confirmed_not_happened'))
    THEN
        RAISE EXCEPTION 'rundesk: action_effect_dispatched_once: effect % would be dispatched % '
            'times; each dispatch after the first needs an operator''s decision',
            NEW.step_key, NEW.attempts
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER runs_action_effect_dispatches BEFORE INSERT OR UPDATE OF attempts ON runs_action
    FOR EACH ROW EXECUTE FUNCTION rundesk_effect_dispatches();
CREATE TRIGGER runs_operatordecision_immutable BEFORE UPDATE OR DELETE ON runs_operatordecision
    FOR EACH ROW EXECUTE FUNCTION rundesk_refuse_change();
"""

UNDO = """
DROP TRIGGER runs_operatordecision_immutable ON runs_operatordecision;
DROP TRIGGER runs_action_effect_dispatches ON runs_action;
DROP FUNCTION rundesk_effect_dispatches();
"""


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0007_run_cancel_by_queued_at_revision_model_calls'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='OperatorDecision',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('decided_by', models.CharField(max_length=150)),
                ('choice', models.CharField(choices=[('confirmed_happened', 'confirmed: it happened'), ('resend_same_identity', 'send again under the same identity'), ('confirmed_not_happened', 'confirmed: it did not happen'), ('check_again', 'check the evidence again'), ('written', 'written'), ('not_written', 'not written'), ('resume', 'resume the run'), ('abandon', 'abandon the run')], max_length=30)),
                ('reason', models.TextField(blank=True)),
                ('reference', models.CharField(blank=True, help_text='e.g. a delivery id', max_length=300)),
                ('evidence', models.JSONField(help_text='The evidence shown when deciding')),
                ('evidence_digest', models.CharField(max_length=64)),
                ('state_before', models.CharField(max_length=20)),
                ('state_after', models.CharField(max_length=20)),
                ('request_token', models.CharField(max_length=100, unique=True)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'ordering': ['created_at', 'id'],
            },
        ),
        migrations.RemoveConstraint(
            model_name='action',
            name='action_effect_dispatched_once',
        ),
        migrations.AlterField(
            model_name='runevent',
            name='kind',
            field=models.CharField(choices=[('submitted', 'Submitted'), ('lease_acquired', 'Lease Acquired'), ('lease_released', 'Lease Released'), ('lease_lost', 'Lease Lost'), ('resumed', 'Resumed'), ('action_dispatched', 'Action Dispatched'), ('action_redispatched', 'Action Redispatched'), ('action_reused', 'Action Reused'), ('action_completed', 'Action Completed'), ('action_failed', 'Action Failed'), ('action_unknown', 'Action Unknown'), ('write_fenced', 'Write Fenced'), ('revision_published', 'Revision Published'), ('phase_changed', 'Phase Changed'), ('needs_operator', 'Needs Operator'), ('run_completed', 'Run Completed'), ('run_failed', 'Run Failed'), ('run_cancelled', 'Run Cancelled'), ('checkpoint_saved', 'Checkpoint Saved'), ('checkpoint_failed', 'Checkpoint Failed'), ('checkpoint_used', 'Checkpoint Used'), ('checkpoint_ignored', 'Checkpoint Ignored'), ('commit_unanswered', 'Commit Unanswered'), ('outcome_settled', 'Outcome Settled'), ('outcome_open', 'Outcome Open'), ('fault_injected', 'Fault Injected'), ('source_changed', 'Source Changed'), ('cancel_requested', 'Cancel Requested'), ('run_requeued', 'Run Requeued'), ('decision', 'Decision'), ('events_lost', 'Events Lost')], max_length=40),
        ),
        migrations.AddField(
            model_name='operatordecision',
            name='action',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='decisions', to='runs.action'),
        ),
        migrations.AddField(
            model_name='operatordecision',
            name='item',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='decisions', to='runs.outcomeitem'),
        ),
        migrations.AddField(
            model_name='operatordecision',
            name='run',
            field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='decisions', to='runs.run'),
        ),
        migrations.AddField(
            model_name='operatordecision',
            name='user',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddIndex(
            model_name='operatordecision',
            index=models.Index(condition=models.Q(('choice__in', ['resend_same_identity', 'confirmed_not_happened'])), fields=['action'], name='decision_authorising_idx'),
        ),
        migrations.AddConstraint(
            model_name='operatordecision',
            constraint=models.UniqueConstraint(condition=models.Q(('item__isnull', False), ('state_after', 'resolved')), fields=('item',), name='decision_one_settles_an_item'),
        ),
        migrations.AddConstraint(
            model_name='operatordecision',
            constraint=models.CheckConstraint(condition=models.Q(('user__isnull', True), models.Q(('reason', ''), _negated=True), _connector='OR'), name='decision_person_says_why'),
        ),
        migrations.RunSQL(DISPATCHES, UNDO),
    ]
