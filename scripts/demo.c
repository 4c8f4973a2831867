/* toonflow demo: a pan/zoom with motion over a still photo, stylized by toonflow, written as a
 * side-by-side video (input left, toonflow right) plus a few PNG stills of the same frames.
 *
 *   photo ─ imagefreeze ─ compositor "camera" (pad xpos/ypos/width/height animated with
 *   GstController: the pan/zoom) ─ tee ─┬──────────────────────────────┬─ compositor "sbs"
 *                                       └─ NV12 ─ toonflow ─ (right) ──┘    │
 *                                 textoverlay labels, tee ─ x264enc ─ mp4mux ─ out.mp4
 *                                                       └─ chosen frames ─ scale ─ pngenc ─ stills
 *
 * Built and run by scripts/demo.sh (gcc + pkg-config gstreamer-1.0 gstreamer-controller-1.0).
 * Usage: toonflow-demo PHOTO OUT.mp4 STILLS_DIR [WIDTH HEIGHT SECONDS]
 */
#include <gst/gst.h>
#include <gst/controller/gstinterpolationcontrolsource.h>
#include <gst/controller/gstdirectcontrolbinding.h>
#include <stdio.h>
#include <stdlib.h>

#define FPS 30
#define PHOTO_SIZE 512.0        /* the shipped photos are scaled as if 512 px square */

/* Camera keyframes: time as a fraction of the clip, scale of the photo, the photo point (in
 * 512-px photo coordinates) to centre. Positions are clamped so no border shows. */
static const struct
{
  double at, scale, cx, cy;
} keys[] = {
  {0.00, 1.25, 256, 115},       /* wide, top of the frame */
  {0.30, 2.50, 225, 100},       /* zoom in on the face */
  {0.60, 2.00, 410, 170},       /* pan to the shuttle model */
  {0.80, 1.60, 170, 385},       /* down to the mission patch */
  {1.00, 1.25, 256, 300},       /* back out */
};

static int still_frames[3];
static GstClockTime frame_duration;

static void
bind (GstObject * pad, const char *prop, GstControlSource ** cs)
{
  *cs = gst_interpolation_control_source_new ();
  g_object_set (*cs, "mode", GST_INTERPOLATION_MODE_CUBIC_MONOTONIC, NULL);
  gst_object_add_control_binding (pad,
      gst_direct_control_binding_new_absolute (pad, prop, *cs));
}

static double
clamp (double v, double lo, double hi)
{
  return v < lo ? lo : v > hi ? hi : v;
}

/* Keeps only the frames chosen for stills. */
static GstPadProbeReturn
pick_stills (GstPad * pad, GstPadProbeInfo * info, gpointer data)
{
  GstBuffer *buf = GST_PAD_PROBE_INFO_BUFFER (info);
  int frame = (int) ((GST_BUFFER_PTS (buf) + frame_duration / 2) / frame_duration);
  (void) pad;
  (void) data;
  for (unsigned i = 0; i < G_N_ELEMENTS (still_frames); i++)
    if (frame == still_frames[i])
      return GST_PAD_PROBE_OK;
  return GST_PAD_PROBE_DROP;
}

int
main (int argc, char **argv)
{
  int w = 640, h = 360;
  double seconds = 8.0;
  GError *err = NULL;

  gst_init (&argc, &argv);
  if (argc != 4 && argc != 7) {
    g_printerr ("usage: %s PHOTO OUT.mp4 STILLS_DIR [WIDTH HEIGHT SECONDS]\n", argv[0]);
    return 1;
  }
  if (argc == 7) {
    w = atoi (argv[4]) & ~1;
    h = atoi (argv[5]) & ~1;
    seconds = atof (argv[6]);
  }
  int frames = (int) (seconds * FPS + 0.5);
  frame_duration = gst_util_uint64_scale_int (GST_SECOND, 1, FPS);
  still_frames[0] = frames * 22 / 100;
  still_frames[1] = frames * 52 / 100;
  still_frames[2] = frames * 78 / 100;

  /* Both compositors' output caps name interlace-mode=progressive. Without it the "camera"
   * compositor leaves the field out of its caps, and as soon as "sbs" has configured one input it
   * answers caps queries on the other with interlace-mode=progressive; caps without the field are
   * not a subset of those, so whichever branch sends its caps second (usually the toonflow branch)
   * was refused and the stream stopped with not-negotiated, depending on thread timing. */
  gchar *desc = g_strdup_printf (
      "filesrc location=\"%s\" ! decodebin ! videoconvert ! video/x-raw,format=AYUV "
      "! imagefreeze num-buffers=%d ! video/x-raw,framerate=%d/1 ! camera.sink_0 "
      "compositor name=camera background=black "
      "! video/x-raw,format=AYUV,width=%d,height=%d,framerate=%d/1,interlace-mode=progressive "
      "! tee name=split "
      "split. ! queue ! videoconvert ! video/x-raw,format=NV12 ! toonflow name=toon "
      "! videoconvert ! textoverlay text=toonflow valignment=top halignment=right "
      "font-desc=\"Sans Bold 14\" ! sbs.sink_1 "
      "split. ! queue ! videoconvert ! textoverlay text=input valignment=top halignment=left "
      "font-desc=\"Sans Bold 14\" ! sbs.sink_0 "
      "compositor name=sbs sink_1::xpos=%d "
      "! video/x-raw,width=%d,height=%d,interlace-mode=progressive "
      "! tee name=out "
      "out. ! queue ! videoconvert ! video/x-raw,format=I420 "
      "! x264enc speed-preset=faster bitrate=4000 key-int-max=60 ! h264parse "
      "! mp4mux faststart=true ! filesink location=\"%s\" "
      "out. ! queue name=stills ! videoconvert ! videoscale "
      "! video/x-raw,format=RGB,width=960,height=%d ! pngenc "
      "! multifilesink async=false location=\"%s/demo-%%d.png\"",
      argv[1], frames, FPS, w, h, FPS, w, 2 * w, h, argv[2],
      (960 * h / (2 * w)) & ~1, argv[3]);
  GstElement *pipeline = gst_parse_launch (desc, &err);
  if (!pipeline) {
    g_printerr ("pipeline: %s\n%s\n", err->message, desc);
    return 2;
  }
  g_free (desc);

  /* The pan/zoom: the photo's pad on the "camera" compositor, animated. */
  GstElement *camera = gst_bin_get_by_name (GST_BIN (pipeline), "camera");
  GstPad *pad = gst_element_get_static_pad (camera, "sink_0");
  GstControlSource *xs, *ys, *ws, *hs;
  bind (GST_OBJECT (pad), "xpos", &xs);
  bind (GST_OBJECT (pad), "ypos", &ys);
  bind (GST_OBJECT (pad), "width", &ws);
  bind (GST_OBJECT (pad), "height", &hs);
  for (unsigned i = 0; i < G_N_ELEMENTS (keys); i++) {
    /* the photo is shown so that its shorter side covers the frame at scale 1.25 of 640x360 */
    double size = keys[i].scale * w * 512.0 / 640.0;
    double k = size / PHOTO_SIZE;
    double x = clamp (w / 2.0 - keys[i].cx * k, w - size, 0);
    double y = clamp (h / 2.0 - keys[i].cy * k, h - size, 0);
    GstClockTime t = (GstClockTime) (keys[i].at * (frames - 1)) * frame_duration;
    gst_timed_value_control_source_set (GST_TIMED_VALUE_CONTROL_SOURCE (xs), t, x);
    gst_timed_value_control_source_set (GST_TIMED_VALUE_CONTROL_SOURCE (ys), t, y);
    gst_timed_value_control_source_set (GST_TIMED_VALUE_CONTROL_SOURCE (ws), t, size);
    gst_timed_value_control_source_set (GST_TIMED_VALUE_CONTROL_SOURCE (hs), t, size);
  }

  GstElement *stills = gst_bin_get_by_name (GST_BIN (pipeline), "stills");
  GstPad *stills_pad = gst_element_get_static_pad (stills, "sink");
  gst_pad_add_probe (stills_pad, GST_PAD_PROBE_TYPE_BUFFER, pick_stills, NULL, NULL);

  g_print ("demo: %d frames of %dx%d per side at %d fps, stills at frames %d, %d, %d\n",
      frames, w, h, FPS, still_frames[0], still_frames[1], still_frames[2]);
  gint64 start = g_get_monotonic_time ();
  gst_element_set_state (pipeline, GST_STATE_PLAYING);
  GstBus *bus = gst_element_get_bus (pipeline);
  int rc = 0;
  for (;;) {
    GstMessage *msg = gst_bus_timed_pop_filtered (bus, GST_CLOCK_TIME_NONE,
        GST_MESSAGE_EOS | GST_MESSAGE_ERROR | GST_MESSAGE_WARNING);
    if (GST_MESSAGE_TYPE (msg) == GST_MESSAGE_WARNING) {
      GError *e = NULL;
      gst_message_parse_warning (msg, &e, NULL);
      g_print ("warning from %s: %s\n", GST_OBJECT_NAME (GST_MESSAGE_SRC (msg)), e->message);
      g_clear_error (&e);
      gst_message_unref (msg);
      continue;
    }
    if (GST_MESSAGE_TYPE (msg) == GST_MESSAGE_ERROR) {
      GError *e = NULL;
      gchar *dbg = NULL;
      gst_message_parse_error (msg, &e, &dbg);
      g_printerr ("error from %s: %s\n%s\n", GST_OBJECT_NAME (GST_MESSAGE_SRC (msg)),
          e->message, dbg ? dbg : "");
      g_clear_error (&e);
      g_free (dbg);
      rc = 2;
    }
    gst_message_unref (msg);
    break;
  }
  double elapsed = (g_get_monotonic_time () - start) / 1e6;

  GstElement *toon = gst_bin_get_by_name (GST_BIN (pipeline), "toon");
  GstStructure *s = NULL;
  g_object_get (toon, "stats", &s, NULL);
  if (s && rc == 0) {
    double mean_us = 0;
    gst_structure_get_double (s, "mean-us", &mean_us);
    g_print ("demo: done in %.1f s; toonflow backend=%s, %.1f ms per frame (%.1f fps)\n",
        elapsed, gst_structure_get_string (s, "backend"), mean_us / 1000.0,
        mean_us > 0 ? 1e6 / mean_us : 0.0);
  }
  if (s)
    gst_structure_free (s);
  gst_element_set_state (pipeline, GST_STATE_NULL);
  gst_object_unref (toon);
  gst_object_unref (stills_pad);
  gst_object_unref (stills);
  gst_object_unref (pad);
  gst_object_unref (camera);
  gst_object_unref (bus);
  gst_object_unref (pipeline);
  return rc;
}
