"""The installation's last sweep, an executor's or Celery beat's
(runs.models.SweepTurn): every executor swept every RUNDESK_SWEEP_SECONDS,
so N executors swept N times an interval, each asking about every open
item again; an executor now sweeps only if nobody did for half an
interval (runs/sweep.py, `take_turn`)."""

from django.db import migrations, models
from django.db.models import Q


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0030_claim_reads_what_it_takes"),
    ]

    operations = [
        migrations.CreateModel(
            name="SweepTurn",
            fields=[
                ("id", models.PositiveSmallIntegerField(primary_key=True, serialize=False)),
                ("started_at", models.DateTimeField()),
                ("taken_by", models.CharField(max_length=200)),
            ],
            options={
                "constraints": [
                    models.CheckConstraint(condition=Q(id=1), name="sweep_turn_one_row")
                ],
            },
        ),
    ]
