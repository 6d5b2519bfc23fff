from django.db import migrations, models

# Reports imported before this migration: their summary names the process
# whose log line carried the report ("; reported by N"), the one PostgreSQL
# ended; it is the victim where it is one of the report's waiters.
VICTIMS_OF_EARLIER_IMPORTS = r"""
    UPDATE evidence_lockincident AS i
    SET victim_pid = substring(i.summary from '; reported by (\d{1,9})$')::integer
    WHERE i.source = 'log'
      AND i.summary ~ '; reported by \d{1,9}$'
      AND EXISTS (
          SELECT 1 FROM evidence_lockwait w
          WHERE w.incident_id = i.id AND NOT w.lead_up
            AND w.waiter_pid = substring(i.summary from '; reported by (\d{1,9})$')::integer
      )
"""


class Migration(migrations.Migration):
    dependencies = [
        ("evidence", "0007_imported_lock_incidents"),
    ]

    operations = [
        migrations.AddField(
            model_name="lockincident",
            name="victim_pid",
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.RunSQL(VICTIMS_OF_EARLIER_IMPORTS, migrations.RunSQL.noop),
    ]
