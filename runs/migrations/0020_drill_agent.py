"""A drill runs its scenarios against each agent that declares a drill
input, and each result names its agent: the results before were the
research agent's.  The drills page reads each scenario's newest results per
agent (its index now leads with both)."""

import django.contrib.postgres.fields
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("runs", "0019_run_agent")]

    operations = [
        migrations.AddField(
            model_name="drill",
            name="agents",
            field=django.contrib.postgres.fields.ArrayField(
                base_field=models.CharField(max_length=63), default=list, size=None
            ),
        ),
        migrations.AddField(
            model_name="drillresult",
            name="agent",
            field=models.CharField(default="research", max_length=63),
        ),
        migrations.RemoveIndex(model_name="drillresult", name="drill_result_history_idx"),
        migrations.AddIndex(
            model_name="drillresult",
            index=models.Index(
                fields=["scenario", "agent", "-created_at"], name="drill_result_history_idx"
            ),
        ),
    ]
