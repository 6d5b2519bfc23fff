# A statement that must change nothing when its owner was fenced out calls
# rundesk_fenced_out(): the error rolls back everything the statement did
# (publication marks the model calls it used before its fence is checked).

from django.db import migrations

FUNCTION = """
CREATE FUNCTION rundesk_fenced_out() RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'rundesk: fenced out: this owner no longer holds the run'
        USING ERRCODE = 'RDF01';
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("runs", "0005_listing_indexes_and_groups")]

    operations = [migrations.RunSQL(FUNCTION, "DROP FUNCTION rundesk_fenced_out();")]
