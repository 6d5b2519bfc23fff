# rundesk_xid(announce) is the transaction id a write stores with its row.
# With announce, it also tells the writer before COMMIT, so a writer whose
# COMMIT gets no answer still knows which transaction to ask
# pg_xact_status() about (runs/outcomes.py): INFO messages go to the client
# whatever client_min_messages says, and the server flushes them at once.
# Checkpoints and answer revisions announce; receipts, written on every
# step, do not (the extra message costs ~0.1 ms a step): an orphaned
# receipt transaction is found by its backend in pg_stat_activity instead.
#
# `rundesk.stall_after_announce_ms` is the fault plan's hook for
# drop_connection_at_commit (runs/faults.py): the transaction stays open for
# that long after announcing, so the fault can cut the connection while it
# is in flight.  Unset, it costs one lookup.
#
# Checkpoints and outcome items are records: an unknown checkpoint and an
# open item are settled once (outcome, time, resolution); nothing else about
# them changes, and nothing deletes them.

from django.db import migrations

ANNOUNCE = """
CREATE FUNCTION rundesk_xid(announce boolean) RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    xid xid8 := pg_current_xact_id();
    stall text := current_setting('rundesk.stall_after_announce_ms', true);
BEGIN
    IF announce THEN
        RAISE INFO 'rundesk:xid %', xid;
    END IF;
    IF stall IS NOT NULL AND stall <> '' THEN
        PERFORM pg_sleep(stall::numeric / 1000);
    END IF;
    RETURN xid::text::bigint;
END
$$;
"""

CHECKPOINT_RULES = """
CREATE FUNCTION rundesk_checkpoint_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
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
CREATE TRIGGER runs_checkpoint_rules BEFORE UPDATE OR DELETE ON runs_checkpoint
    FOR EACH ROW EXECUTE FUNCTION rundesk_checkpoint_change();

CREATE FUNCTION rundesk_outcome_item_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
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
CREATE TRIGGER runs_outcomeitem_rules BEFORE UPDATE OR DELETE ON runs_outcomeitem
    FOR EACH ROW EXECUTE FUNCTION rundesk_outcome_item_change();
"""


class Migration(migrations.Migration):
    dependencies = [("runs", "0003_checkpoints_outcomes")]

    operations = [
        migrations.RunSQL(ANNOUNCE, "DROP FUNCTION rundesk_xid(boolean);"),
        migrations.RunSQL(
            CHECKPOINT_RULES,
            "DROP TRIGGER runs_outcomeitem_rules ON runs_outcomeitem;"
            "DROP FUNCTION rundesk_outcome_item_change();"
            "DROP TRIGGER runs_checkpoint_rules ON runs_checkpoint;"
            "DROP FUNCTION rundesk_checkpoint_change();",
        ),
    ]
