"""rundesk_pending_receipts(): the receipts a write carries, as rows, which
the planner reckons one (ROWS 1; plpgsql, so that no plan inlines it and
forgets that), whatever their number: each receipt then finds its action
by its id, one probe of the primary key, in every plan PostgreSQL may keep
for the write (runs/leases.py, RECEIPT_CTES).  Seen as `unnest()` of a
parameter, ten rows, the receipts made a plan that read every action of
the run look cheaper: in a run of thousands of steps, each step read them
all."""

from django.db import migrations

FUNCTION = """
CREATE FUNCTION rundesk_pending_receipts(
    action_ids bigint[], results jsonb[], result_digests text[]
) RETURNS TABLE (action_id bigint, result jsonb, result_digest text)
LANGUAGE plpgsql IMMUTABLE ROWS 1 AS $$
BEGIN
    RETURN QUERY SELECT * FROM unnest(action_ids, results, result_digests);
END
$$;
"""
UNDO = "DROP FUNCTION rundesk_pending_receipts(bigint[], jsonb[], text[]);"


class Migration(migrations.Migration):
    dependencies = [("runs", "0028_action_approved_when_dispatched")]

    operations = [migrations.RunSQL(FUNCTION, UNDO)]
