# Retention (runs/retention.py) removes ended runs with all their rows.  The
# facts' triggers refuse DELETE to everyone else, as before; they let a row
# go only when the transaction set `rundesk.purge` (SET LOCAL: it ends with
# the transaction, and only the purge sets it) and the row's run has ended;
# an outcome item only once it is settled.  UPDATE stays refused as it was.
#
# The purge's "ended before" and /metrics' recent durations are served by
# run_finished_idx (migration 0025, the sort by end); event_resumed_idx
# serves /metrics' lease takeovers, built CONCURRENTLY: runs_runevent is
# written on every step, and a plain CREATE INDEX would stop those writes
# for as long as it reads them.

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models

PURGING = """
CREATE OR REPLACE FUNCTION rundesk_purging(run bigint) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT coalesce(current_setting('rundesk.purge', true), '') = 'on'
       AND EXISTS (SELECT 1 FROM runs_run
                   WHERE id = run AND status IN ('completed', 'failed', 'cancelled'))
$$;

CREATE OR REPLACE FUNCTION rundesk_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND rundesk_purging(OLD.run_id) THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'rundesk: % on % is refused: its rows are immutable', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation';
END
$$;
"""

# An approval is decided once and never deleted (migration 0023), but with
# its ended run, by the purge.
APPROVAL_RULE = """
CREATE OR REPLACE FUNCTION rundesk_approval_decided_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND OLD.state <> 'pending' AND rundesk_purging(OLD.run_id) THEN
        RETURN OLD;
    END IF;
    IF TG_OP = 'DELETE' OR OLD.state <> 'pending'
        OR (NEW.run_id, NEW.item_id, NEW.step_key, NEW.tool, NEW.proposed,
            NEW.proposed_digest, NEW.approvers, NEW.expires_at, NEW.created_at)
        IS DISTINCT FROM (OLD.run_id, OLD.item_id, OLD.step_key, OLD.tool, OLD.proposed,
            OLD.proposed_digest, OLD.approvers, OLD.expires_at, OLD.created_at)
    THEN
        RAISE EXCEPTION 'rundesk: approval % is decided once: % refused', OLD.id, TG_OP
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
$$;
"""

CHECKPOINT_RULES = """
CREATE OR REPLACE FUNCTION rundesk_checkpoint_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF rundesk_purging(OLD.run_id) THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION 'rundesk: DELETE on runs_checkpoint is refused: checkpoints are records'
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF (NEW.run_id, NEW.after_action_id, NEW.number, NEW.epoch, NEW.state, NEW.state_digest,
        NEW.xid, NEW.error, NEW.created_at)
       IS DISTINCT FROM
       (OLD.run_id, OLD.after_action_id, OLD.number, OLD.epoch, OLD.state, OLD.state_digest,
        OLD.xid, OLD.error, OLD.created_at)
    THEN
        RAISE EXCEPTION 'rundesk: a checkpoint''s content cannot change, only its outcome'
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF OLD.outcome <> 'unknown' OR NEW.outcome NOT IN ('resolved_committed', 'resolved_not_written')
    THEN
        RAISE EXCEPTION 'rundesk: checkpoint outcome % cannot become %', OLD.outcome, NEW.outcome
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION rundesk_outcome_item_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF OLD.state <> 'open' AND rundesk_purging(OLD.run_id) THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION 'rundesk: DELETE on runs_outcomeitem is refused: items are records'
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF OLD.state <> 'open' OR NEW.state <> 'resolved'
       OR (NEW.run_id, NEW.kind, NEW.subject, NEW.action_id, NEW.checkpoint_id,
           NEW.revision_number, NEW.xid, NEW.summary, NEW.created_at)
          IS DISTINCT FROM
          (OLD.run_id, OLD.kind, OLD.subject, OLD.action_id, OLD.checkpoint_id,
           OLD.revision_number, OLD.xid, OLD.summary, OLD.created_at)
    THEN
        RAISE EXCEPTION 'rundesk: an outcome item is settled once, open to resolved'
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
$$;
"""

# Back to refusing every DELETE, as migrations 0002 and 0004 did: the
# checkpoint's and the item's functions ask rundesk_purging, which then
# always answers no.
UNDO = """
CREATE OR REPLACE FUNCTION rundesk_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rundesk: % on % is refused: its rows are immutable', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation';
END
$$;
CREATE OR REPLACE FUNCTION rundesk_purging(run bigint) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT false
$$;
"""


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY cannot run in a transaction.
    atomic = False

    dependencies = [
        ("runs", "0026_action_dispatched_idx"),
    ]

    operations = [
        migrations.CreateModel(
            name="PurgedCount",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("counter", models.CharField(max_length=60)),
                ("label", models.CharField(blank=True, max_length=60)),
                ("value", models.BigIntegerField(default=0)),
            ],
        ),
        migrations.AddConstraint(
            model_name="purgedcount",
            constraint=models.UniqueConstraint(fields=("counter", "label"), name="purged_count_unique"),
        ),
        AddIndexConcurrently(
            model_name="runevent",
            index=models.Index(condition=models.Q(("kind", "resumed")), fields=["id"], name="event_resumed_idx"),
        ),
        migrations.RunSQL(PURGING + APPROVAL_RULE + CHECKPOINT_RULES, UNDO),
    ]
