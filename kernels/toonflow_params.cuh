// Shared constants and the parameter block of the toonflow kernels.
// Mirrors `ToonParams` in src/pipeline/params.rs field for field (a Rust unit test checks the
// size and the constants below); no host headers.
#pragma once

#define TF_MAX_RADIUS 24
#define TF_THUMB_W 64
#define TF_THUMB_H 36
#define TF_HIST_BINS 256
#define TF_MAX_HISTORY 8

struct ToonParams {
    int width;
    int height;
    int chroma_width;
    int chroma_height;
    int thumb_w;
    int thumb_h;
    int bilateral_iterations;
    int edge_iteration;
    int levels;
    int history;
    int auto_levels;
    int luma_radius;
    int chroma_radius;
    int edge_radius;
    float range_coeff;
    float edge_tau;
    float edge_sharpness;
    float edge_strength;
    float level_sharpness;
    float saturation;
    float temporal_strength;
    float motion_coeff;
    float scene_cut_threshold;
    float luma_spatial[TF_MAX_RADIUS + 1];
    float chroma_spatial[TF_MAX_RADIUS + 1];
    float edge_gauss1[TF_MAX_RADIUS + 1];
    float edge_gauss2[TF_MAX_RADIUS + 1];
};
