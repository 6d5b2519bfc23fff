"""The claim of the oldest queued runs (runs/lifecycle.py, CLAIM_NEXT_SQL)
reads the runs it takes and stops, however large the queue.

It read every queued run and sorted them, at each claim: with a backlog of
thousands, each claim cost milliseconds of the server's CPU, more than a
step.  The planner chose that wherever its statistics, taken while the
queue was short, said a few runs were queued: reading them all and
sorting them looks cheaper than walking an index, then.

- run_queued_idx holds the queued runs in the claim's order (created_at,
  id), so that a walk of the index yields them oldest first;
- rundesk_oldest_queued() takes them from that walk, `most` at most: a
  plpgsql function, planned without the sort or the bitmap scan that would
  read them all (its SET clauses hold while it runs, for its statement
  alone), whatever the statistics say."""

from django.db import migrations, models
from django.db.models import Q

FUNCTION = """
CREATE FUNCTION rundesk_oldest_queued(agents text[], lab boolean, most integer)
RETURNS TABLE (id bigint, created_at timestamptz)
LANGUAGE plpgsql VOLATILE
SET enable_sort = off
SET enable_bitmapscan = off
AS $$
BEGIN
    RETURN QUERY
        SELECT run.id, run.created_at FROM runs_run AS run
        WHERE run.status = 'queued' AND run.agent = ANY(agents)
          AND run.imported_at IS NULL AND run.is_drill = lab
        ORDER BY run.created_at, run.id
        LIMIT most
        FOR NO KEY UPDATE SKIP LOCKED;
END
$$;
"""
UNDO = "DROP FUNCTION rundesk_oldest_queued(text[], boolean, integer);"


class Migration(migrations.Migration):
    dependencies = [("runs", "0029_pending_receipts")]

    operations = [
        migrations.RemoveIndex(model_name="run", name="run_queued_idx"),
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                fields=["created_at", "id"],
                name="run_queued_idx",
                condition=Q(status="queued"),
            ),
        ),
        migrations.RunSQL(FUNCTION, UNDO),
    ]
