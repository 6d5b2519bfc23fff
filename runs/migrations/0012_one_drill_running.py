# One drill at a time (two would kill processes and lock tables under each
# other): at most one row may be running.  Drills that raced past the old
# check before this migration are ended, all but the newest.

from django.db import migrations, models

END_ALL_BUT_NEWEST = """
UPDATE runs_drill SET state = 'done', finished_at = now(),
    error = 'ended by migration 0012: another drill was running at the same time'
WHERE state = 'running' AND id <> (
    SELECT id FROM runs_drill WHERE state = 'running' ORDER BY started_at DESC, id DESC LIMIT 1)
"""


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0011_effect_dispatches_trigger_when"),
    ]

    operations = [
        migrations.RunSQL(END_ALL_BUT_NEWEST, migrations.RunSQL.noop),
        migrations.AddConstraint(
            model_name="drill",
            constraint=models.UniqueConstraint(
                condition=models.Q(("state", "running")),
                fields=("state",),
                name="one_drill_running",
            ),
        ),
    ]
