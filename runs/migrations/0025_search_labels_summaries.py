"""Finding runs (runs/finding.py): labels given at submission, a GIN
index of the words the search reads, the sorts' indexes; and the
overview's summaries (runs/summaries.py), with the cursors of the roll-up
that keeps them."""

import django.contrib.postgres.fields
import django.contrib.postgres.indexes
import runs.finding
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0024_bulk_job_choices_with_approvals'),
    ]

    operations = [
        migrations.CreateModel(
            name='RunSummary',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('grain', models.CharField(choices=[('minute', 'Minute'), ('hour', 'Hour'), ('day', 'Day')], max_length=10)),
                ('bucket', models.DateTimeField()),
                ('agent', models.CharField(max_length=63)),
                ('measure', models.CharField(choices=[('submitted', 'Submitted'), ('completed', 'Completed'), ('failed', 'Failed'), ('cancelled', 'Cancelled'), ('step', 'Step')], max_length=20)),
                ('count', models.BigIntegerField(default=0)),
                ('seconds', models.FloatField(default=0)),
                ('histogram', django.contrib.postgres.fields.ArrayField(base_field=models.BigIntegerField(), default=list, size=None)),
            ],
            options={
                'ordering': ['grain', 'bucket', 'agent', 'measure'],
            },
        ),
        migrations.CreateModel(
            name='SummaryCursor',
            fields=[
                ('source', models.CharField(max_length=20, primary_key=True, serialize=False)),
                ('at', models.DateTimeField()),
                ('last_id', models.BigIntegerField(default=0)),
                ('rolled_at', models.DateTimeField(blank=True, null=True)),
            ],
        ),
        migrations.AddField(
            model_name='run',
            name='labels',
            field=models.JSONField(blank=True, db_default=models.Value({}, models.JSONField()), default=dict),
        ),
        migrations.AddIndex(
            model_name='run',
            index=django.contrib.postgres.indexes.GinIndex(runs.finding._Searchable(models.F('question'), models.F('input')), name='run_search_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=django.contrib.postgres.indexes.GinIndex(fields=['labels'], name='run_labels_idx', opclasses=['jsonb_path_ops']),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('started_at__isnull', False)), fields=['started_at', 'id'], name='run_started_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('started_at__isnull', True)), fields=['-created_at', '-id'], name='run_unstarted_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('finished_at__isnull', False)), fields=['finished_at', 'id'], name='run_finished_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('finished_at__isnull', True)), fields=['-created_at', '-id'], name='run_unfinished_idx'),
        ),
        migrations.AddConstraint(
            model_name='runsummary',
            constraint=models.UniqueConstraint(fields=('grain', 'bucket', 'agent', 'measure'), name='run_summary_unique'),
        ),
    ]
