/* toonflow-sample: embeds the toonflow element in a C application.
 *
 * - builds its pipeline with gst_parse_launch (test pattern -> toonflow -> sink),
 * - asks the element for a `toonflow-stats` element message every 10 frames and prints each,
 * - changes properties while PLAYING (levels, edge-strength, saturation) from the bus handler,
 * - reports warnings (e.g. "no CUDA, using the CPU reference") and errors from the element, and
 *   exits non-zero on an error.
 *
 * Usage: toonflow-sample [--backend auto|cpu|cuda] [--frames N] [--size WxH] [--provoke-error]
 *   --provoke-error  backend=cuda with a 1-byte device memory cap: fails on every machine
 *                    (without CUDA when the element starts, with CUDA when it plans its memory)
 * Exit status: 0 at EOS, 1 bad usage, 2 error from the pipeline, 3 no EOS within 60 s.
 * The plugin must be on GST_PLUGIN_PATH (e.g. the repository's target/release).
 */
#include <gst/gst.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct
{
  GMainLoop *loop;
  GstElement *toon;
  int exit_code;
  guint stats_seen;
} App;

/* Property changes applied while PLAYING, one per stats message. */
static void
tweak_properties (App * app, guint64 frames)
{
  static const struct
  {
    guint levels;
    gdouble edge_strength;
    gdouble saturation;
  } steps[] = { {4, 0.5, 1.0}, {12, 1.0, 1.5}, {6, 0.8, 0.0} };
  guint i = app->stats_seen % G_N_ELEMENTS (steps);
  guint levels;
  gfloat strength;

  /* Float properties take a double through the varargs, as always in C. */
  g_object_set (app->toon, "levels", steps[i].levels,
      "edge-strength", steps[i].edge_strength,
      "saturation", steps[i].saturation, NULL);
  g_object_get (app->toon, "levels", &levels, "edge-strength", &strength, NULL);
  g_print ("set while PLAYING after frame %" G_GUINT64_FORMAT
      ": levels=%u edge-strength=%.2f saturation=%.2f\n", frames, levels,
      strength, steps[i].saturation);
}

static gboolean
on_message (GstBus * bus, GstMessage * msg, gpointer user_data)
{
  App *app = user_data;
  (void) bus;

  switch (GST_MESSAGE_TYPE (msg)) {
    case GST_MESSAGE_ELEMENT:{
      const GstStructure *s = gst_message_get_structure (msg);
      if (GST_MESSAGE_SRC (msg) == GST_OBJECT (app->toon)
          && gst_structure_has_name (s, "toonflow-stats")) {
        gchar *text = gst_structure_to_string (s);
        guint64 frames = 0;
        const gchar *backend = gst_structure_get_string (s, "backend");
        gst_structure_get_uint64 (s, "frames", &frames);
        g_print ("stats: backend=%s frames=%" G_GUINT64_FORMAT "\n  %s\n",
            backend ? backend : "?", frames, text);
        g_free (text);
        tweak_properties (app, frames);
        app->stats_seen++;
      }
      break;
    }
    case GST_MESSAGE_WARNING:{
      GError *err = NULL;
      gchar *debug = NULL;
      gst_message_parse_warning (msg, &err, &debug);
      g_print ("warning from %s: %s\n", GST_OBJECT_NAME (GST_MESSAGE_SRC (msg)),
          err->message);
      g_clear_error (&err);
      g_free (debug);
      break;
    }
    case GST_MESSAGE_ERROR:{
      GError *err = NULL;
      gchar *debug = NULL;
      gst_message_parse_error (msg, &err, &debug);
      g_printerr ("error from element %s: %s\n",
          GST_OBJECT_NAME (GST_MESSAGE_SRC (msg)), err->message);
      if (debug)
        g_printerr ("  debug: %s\n", debug);
      g_clear_error (&err);
      g_free (debug);
      app->exit_code = 2;
      g_main_loop_quit (app->loop);
      break;
    }
    case GST_MESSAGE_EOS:
      g_print ("EOS\n");
      g_main_loop_quit (app->loop);
      break;
    default:
      break;
  }
  return G_SOURCE_CONTINUE;
}

static gboolean
on_timeout (gpointer user_data)
{
  App *app = user_data;
  g_printerr ("no EOS within 60 s\n");
  app->exit_code = 3;
  g_main_loop_quit (app->loop);
  return G_SOURCE_REMOVE;
}

int
main (int argc, char **argv)
{
  const gchar *backend = "auto";
  gint frames = 45, width = 320, height = 240;
  gboolean provoke_error = FALSE;
  App app = { 0 };
  GstElement *pipeline;
  GstBus *bus;
  GError *err = NULL;
  gchar *description;
  GstStructure *stats = NULL;

  gst_init (&argc, &argv);
  for (int i = 1; i < argc; i++) {
    if (!strcmp (argv[i], "--backend") && i + 1 < argc)
      backend = argv[++i];
    else if (!strcmp (argv[i], "--frames") && i + 1 < argc)
      frames = atoi (argv[++i]);
    else if (!strcmp (argv[i], "--size") && i + 1 < argc
        && sscanf (argv[i + 1], "%dx%d", &width, &height) == 2)
      i++;
    else if (!strcmp (argv[i], "--provoke-error"))
      provoke_error = TRUE;
    else {
      g_printerr ("usage: %s [--backend auto|cpu|cuda] [--frames N] [--size WxH]"
          " [--provoke-error]\n", argv[0]);
      return 1;
    }
  }

  if (!gst_element_factory_find ("toonflow")) {
    g_printerr ("no toonflow element: put libgsttoonflow.so on GST_PLUGIN_PATH\n");
    return 2;
  }

  description = g_strdup_printf ("videotestsrc pattern=ball num-buffers=%d "
      "! video/x-raw,format=NV12,width=%d,height=%d,framerate=30/1 "
      "! toonflow name=toon backend=%s stats-interval=10 %s "
      "! fakesink sync=true", frames, width, height,
      provoke_error ? "cuda" : backend,
      provoke_error ? "max-device-memory=1" : "");
  g_print ("pipeline: %s\n", description);
  pipeline = gst_parse_launch (description, &err);
  g_free (description);
  if (!pipeline) {
    g_printerr ("cannot build the pipeline: %s\n", err->message);
    g_clear_error (&err);
    return 2;
  }
  app.loop = g_main_loop_new (NULL, FALSE);
  app.toon = gst_bin_get_by_name (GST_BIN (pipeline), "toon");

  bus = gst_element_get_bus (pipeline);
  gst_bus_add_watch (bus, on_message, &app);
  g_timeout_add_seconds (60, on_timeout, &app);

  /* A failing start (e.g. backend=cuda without CUDA) returns FAILURE here and posts an error
   * message on the bus, which on_message reports. */
  if (gst_element_set_state (pipeline, GST_STATE_PLAYING) == GST_STATE_CHANGE_FAILURE)
    g_printerr ("the pipeline failed to start\n");
  g_main_loop_run (app.loop);

  g_object_get (app.toon, "stats", &stats, NULL);
  if (stats) {
    gchar *text = gst_structure_to_string (stats);
    g_print ("final stats property: %s\n", text);
    g_free (text);
    gst_structure_free (stats);
  }
  gst_element_set_state (pipeline, GST_STATE_NULL);
  gst_bus_remove_watch (bus);
  gst_object_unref (bus);
  gst_object_unref (app.toon);
  gst_object_unref (pipeline);
  g_main_loop_unref (app.loop);

  if (app.exit_code == 0 && app.stats_seen == 0) {
    g_printerr ("no toonflow-stats message arrived\n");
    app.exit_code = 2;
  }
  g_print ("exit %d: %u stats messages\n", app.exit_code, app.stats_seen);
  return app.exit_code;
}
